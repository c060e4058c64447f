package flatcar

import (
	"bufio"
	"bytes"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/clearsign"
	pgperrors "github.com/ProtonMail/go-crypto/openpgp/errors"
	"github.com/ProtonMail/go-crypto/openpgp/packet"
)

// SigningKeyFingerprint is the fingerprint of the primary key of the Flatcar
// image signing key, "Flatcar Buildbot (Official Builds)".
const SigningKeyFingerprint = "F88CFEDEFF29A5B4D9523864E25D9AED0593B34A"

// The Flatcar image signing key; origin and subkeys in keys/README.md.
//
//go:embed keys/flatcar-image-signing-key.asc
var signingKey []byte

// SigningKey returns the embedded Flatcar image signing key, an armored
// OpenPGP public key with its signing subkeys.
func SigningKey() []byte { return bytes.Clone(signingKey) }

// ReadKeyring parses an OpenPGP public keyring, armored or binary, and
// checks that it holds at least one key that may sign.
func ReadKeyring(data []byte) (openpgp.EntityList, error) {
	var (
		el  openpgp.EntityList
		err error
	)
	if bytes.Contains(data, []byte("-----BEGIN PGP")) {
		el, err = openpgp.ReadArmoredKeyRing(bytes.NewReader(data))
	} else {
		el, err = openpgp.ReadKeyRing(bytes.NewReader(data))
	}
	if err != nil {
		return nil, fmt.Errorf("read OpenPGP keyring: %w", err)
	}
	for _, e := range el {
		if e.PrimaryKey.CanSign() {
			return el, nil
		}
		for _, s := range e.Subkeys {
			if s.Sig != nil && s.Sig.FlagsValid && s.Sig.FlagSign {
				return el, nil
			}
		}
	}
	return nil, errors.New("read OpenPGP keyring: no signing key in it")
}

// verifyClearSigned checks the OpenPGP clear signature of data against
// keyring and returns the signed text and the signer's key ID. A signature by
// a subkey that has expired since is accepted when the subkey was valid when
// the signature was made; a revoked key is never accepted.
func verifyClearSigned(keyring openpgp.EntityList, data []byte, now time.Time) (text []byte, signer string, err error) {
	block, rest := clearsign.Decode(data)
	if block == nil {
		return nil, "", fmt.Errorf("%w: not an OpenPGP clear-signed message", ErrVerify)
	}
	if len(bytes.TrimSpace(rest)) > 0 {
		return nil, "", fmt.Errorf("%w: data after the clear-signed message", ErrVerify)
	}
	check := func(at time.Time) (*packet.Signature, error) {
		b, _ := clearsign.Decode(data) // the signature reader is single use
		sig, _, err := openpgp.VerifyDetachedSignature(keyring, bytes.NewReader(b.Bytes), b.ArmoredSignature.Body,
			&packet.Config{Time: func() time.Time { return at }})
		return sig, err
	}
	sig, err := check(now)
	if errors.Is(err, pgperrors.ErrKeyExpired) && sig != nil && !sig.CreationTime.After(now) {
		sig, err = check(sig.CreationTime)
	}
	if err != nil {
		if errors.Is(err, pgperrors.ErrUnknownIssuer) {
			return nil, "", fmt.Errorf("%w: signature by a key not in the keyring (update the Flatcar signing key): %w", ErrVerify, err)
		}
		return nil, "", fmt.Errorf("%w: bad signature: %w", ErrVerify, err)
	}
	if sig.IssuerKeyId != nil {
		signer = fmt.Sprintf("%016X", *sig.IssuerKeyId)
	}
	return block.Plaintext, signer, nil
}

// digestLengths are the hex lengths of the digests Flatcar publishes.
var digestLengths = map[string]int{"MD5": 32, "SHA1": 40, "SHA256": 64, "SHA512": 128}

// Digests are the contents of a Gentoo-style DIGESTS file: for each hash
// algorithm (upper case, "SHA512"), the lower-case hex digest of each file.
type Digests map[string]map[string]string

// ParseDigests parses a DIGESTS file as Flatcar's make_digests writes it:
// sections that start with a line "# <ALGORITHM> HASH", each followed by
// lines "<hex digest>  <file name>" as sha512sum prints them (" *<name>" for
// binary mode is accepted too). Blank lines are ignored. Anything else, a
// digest of the wrong length for a known algorithm, or two different digests
// for one file and algorithm, is an error wrapping ErrVerify.
func ParseDigests(data []byte) (Digests, error) {
	d := Digests{}
	algo := ""
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), 64<<10)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSuffix(sc.Text(), "\r")
		if strings.TrimSpace(line) == "" {
			continue
		}
		if rest, ok := strings.CutPrefix(line, "# "); ok {
			a, ok := strings.CutSuffix(rest, " HASH")
			if !ok || a == "" || strings.ContainsAny(a, " \t") || strings.ToUpper(a) != a {
				return nil, fmt.Errorf("%w: DIGESTS line %d: bad section header %q", ErrVerify, n, line)
			}
			algo = a
			continue
		}
		if algo == "" {
			return nil, fmt.Errorf("%w: DIGESTS line %d: digest before the first \"# <ALGORITHM> HASH\" line", ErrVerify, n)
		}
		sum, name, ok := strings.Cut(line, "  ")
		if !ok {
			sum, name, ok = strings.Cut(line, " *")
		}
		if !ok || name == "" || strings.ContainsAny(name, "\t/") || strings.TrimSpace(name) != name {
			return nil, fmt.Errorf("%w: DIGESTS line %d: want \"<digest>  <file>\", got %q", ErrVerify, n, line)
		}
		sum = strings.ToLower(sum)
		if _, err := hex.DecodeString(sum); err != nil || sum == "" {
			return nil, fmt.Errorf("%w: DIGESTS line %d: digest is not hex", ErrVerify, n)
		}
		if l, known := digestLengths[algo]; known && len(sum) != l {
			return nil, fmt.Errorf("%w: DIGESTS line %d: %s digest has %d hex digits, want %d", ErrVerify, n, algo, len(sum), l)
		}
		if d[algo] == nil {
			d[algo] = map[string]string{}
		}
		if old, dup := d[algo][name]; dup && old != sum {
			return nil, fmt.Errorf("%w: DIGESTS line %d: two different %s digests for %s", ErrVerify, n, algo, name)
		}
		d[algo][name] = sum
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: DIGESTS: %w", ErrVerify, err)
	}
	return d, nil
}

// SHA512 returns the SHA512 digest for file, or an error wrapping ErrVerify
// when there is none.
func (d Digests) SHA512(file string) ([]byte, error) {
	s, ok := d["SHA512"][file]
	if !ok {
		return nil, fmt.Errorf("%w: the DIGESTS have no SHA512 line for %s", ErrVerify, file)
	}
	return hex.DecodeString(s)
}
