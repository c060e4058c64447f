package precompiled

// crcPoly is the CRC-32 generator polynomial used by the package format, in
// normal (MSB-first, unreflected) form.
const crcPoly = 0x04C11DB7

// crcTables are filled once at package initialisation and only ever read: crcTables[0] is the
// byte-at-a-time table, crcTables[k] advances a byte through k more zero bytes, so that Checksum
// can take eight bytes per step ("slicing by 8").
var crcTables = makeCRCTables()

func makeCRCTables() *[8][256]uint32 {
	var t [8][256]uint32
	for i := range t[0] {
		c := uint32(i) << 24
		for range 8 {
			if c&0x80000000 != 0 {
				c = c<<1 ^ crcPoly
			} else {
				c <<= 1
			}
		}
		t[0][i] = c
	}
	for k := 1; k < len(t); k++ {
		for i := range t[k] {
			c := t[k-1][i]
			t[k][i] = c<<8 ^ t[0][c>>24]
		}
	}
	return &t
}

// Checksum returns the CRC-32/MPEG-2 of data: polynomial 0x04C11DB7 processed
// MSB first, initial value 0xFFFFFFFF, no final XOR. Checksum of "123456789" is
// 0x0376E6E7 and Checksum of no bytes is 0xFFFFFFFF. hash/crc32 cannot compute
// it because it only implements reflected CRCs. It is computed eight bytes at
// a time: packages, linked modules and cache entries are checksummed on every
// start, so this is on the way to Ready.
func Checksum(data []byte) uint32 {
	t := crcTables
	crc := uint32(0xFFFFFFFF)
	for len(data) >= 8 {
		crc ^= uint32(data[0])<<24 | uint32(data[1])<<16 | uint32(data[2])<<8 | uint32(data[3])
		crc = t[7][crc>>24] ^ t[6][crc>>16&0xff] ^ t[5][crc>>8&0xff] ^ t[4][crc&0xff] ^
			t[3][data[4]] ^ t[2][data[5]] ^ t[1][data[6]] ^ t[0][data[7]]
		data = data[8:]
	}
	for _, b := range data {
		crc = t[0][byte(crc>>24)^b] ^ crc<<8
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
