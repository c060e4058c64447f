package precompiled

// crcPoly is the CRC-32 generator polynomial used by the package format, in
// normal (MSB-first, unreflected) form.
const crcPoly = 0x04C11DB7

// crcTable is filled once at package initialisation and only ever read.
var crcTable = makeCRCTable()

func makeCRCTable() [256]uint32 {
	var t [256]uint32
	for i := range t {
		c := uint32(i) << 24
		for range 8 {
			if c&0x80000000 != 0 {
				c = c<<1 ^ crcPoly
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}

// Checksum returns the CRC-32/MPEG-2 of data: polynomial 0x04C11DB7 processed
// MSB first, initial value 0xFFFFFFFF, no final XOR. Checksum of "123456789" is
// 0x0376E6E7 and Checksum of no bytes is 0xFFFFFFFF. hash/crc32 cannot compute
// it because it only implements reflected CRCs.
func Checksum(data []byte) uint32 {
	crc := uint32(0xFFFFFFFF)
	for _, b := range data {
		crc = crcTable[byte(crc>>24)^b] ^ crc<<8
	}
	return crc
}

// StoredCRC returns the CRC that mkprecompiled stores for a member with the
// given contents. It is Checksum(data), except that an empty member is stored
// with CRC 0 (the tool checksums files with a routine that returns 0 for an
// empty file).
func StoredCRC(data []byte) uint32 {
	if len(data) == 0 {
		return 0
	}
	return Checksum(data)
}
