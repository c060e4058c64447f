package flatcar

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/clearsign"
	"github.com/ProtonMail/go-crypto/openpgp/packet"
)

// expiringKey makes a key whose signing subkey lives for an hour, as
// Flatcar's subkeys live for a year or two, and a clear signature by it.
func expiringKey(t *testing.T, text string) (openpgp.EntityList, []byte) {
	t.Helper()
	cfg := &packet.Config{Algorithm: packet.PubKeyAlgoEdDSA}
	e, err := openpgp.NewEntity("expiring", "", "x@example.invalid", cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.AddSigningSubkey(&packet.Config{Algorithm: packet.PubKeyAlgoEdDSA, KeyLifetimeSecs: 3600}); err != nil {
		t.Fatal(err)
	}
	sub := e.Subkeys[len(e.Subkeys)-1]
	var b bytes.Buffer
	w, err := clearsign.Encode(&b, sub.PrivateKey, nil)
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte(text))
	w.Close()
	// A public-only copy, as the embedded key is.
	var pub bytes.Buffer
	if err := e.Serialize(&pub); err != nil {
		t.Fatal(err)
	}
	el, err := openpgp.ReadKeyRing(&pub)
	if err != nil {
		t.Fatal(err)
	}
	return el, b.Bytes()
}

func TestVerifyClearSignedExpiredSubkey(t *testing.T) {
	t.Parallel()
	el, asc := expiringKey(t, "# SHA512 HASH\n")
	// Two hours later the subkey has expired, but it was valid when it
	// signed: accepted, as gpg does for old releases.
	text, signer, err := verifyClearSigned(el, asc, time.Now().Add(2*time.Hour))
	if err != nil {
		t.Fatalf("signature by a since-expired subkey: %v", err)
	}
	if string(text) != "# SHA512 HASH\n" || signer == "" {
		t.Errorf("text %q signer %q", text, signer)
	}
	// A signature made "in the future" of the verifier's clock is not.
	if _, _, err := verifyClearSigned(el, asc, time.Now().Add(-2*time.Hour)); !errors.Is(err, ErrVerify) {
		t.Errorf("signature from the future: %v, want ErrVerify", err)
	}
}

func TestVerifyClearSignedRejects(t *testing.T) {
	t.Parallel()
	el, asc := expiringKey(t, "# SHA512 HASH\nabc  f\n")
	for name, data := range map[string][]byte{
		"not signed":     []byte("# SHA512 HASH\n"),
		"altered text":   bytes.Replace(asc, []byte("abc  f"), []byte("abd  f"), 1),
		"trailing data":  append(append([]byte{}, asc...), []byte("\n# SHA512 HASH\n00  f\n")...),
		"embedded key":   nil, // replaced below: a good signature by a key not in the keyring
		"truncated sig":  asc[:len(asc)-60],
		"signature only": asc[bytes.Index(asc, []byte("-----BEGIN PGP SIGNATURE")):],
	} {
		keyring := el
		if name == "embedded key" {
			k, err := ReadKeyring(SigningKey())
			if err != nil {
				t.Fatal(err)
			}
			keyring, data = k, asc
		}
		if _, _, err := verifyClearSigned(keyring, data, time.Now()); !errors.Is(err, ErrVerify) {
			t.Errorf("%s: %v, want ErrVerify", name, err)
		}
	}
}

func TestParseDigests(t *testing.T) {
	t.Parallel()
	md5 := strings.Repeat("a", 32)
	sha512 := strings.Repeat("B", 128)
	in := "# MD5 HASH\n" + md5 + "  flatcar-container.tar.gz\n" +
		"# SHA1 HASH\n" + strings.Repeat("c", 40) + "  flatcar-container.tar.gz\n" +
		"# SHA512 HASH\r\n" + sha512 + " *flatcar-container.tar.gz\r\n\n" +
		"# SHA512 HASH\n" + strings.Repeat("d", 128) + "  other.bin\n"
	d, err := ParseDigests([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	sum, err := d.SHA512("flatcar-container.tar.gz")
	if err != nil || len(sum) != 64 || sum[0] != 0xbb {
		t.Errorf("SHA512 = %x, %v", sum, err)
	}
	if d["MD5"]["flatcar-container.tar.gz"] != md5 || d["SHA512"]["other.bin"] == "" {
		t.Errorf("Digests = %v", d)
	}
	if _, err := d.SHA512("missing"); !errors.Is(err, ErrVerify) {
		t.Errorf("missing file: %v", err)
	}

	for name, bad := range map[string]string{
		"before header":   sha512 + "  f\n",
		"bad header":      "# SHA512\n",
		"lower header":    "# sha512 HASH\n",
		"one space":       "# SHA512 HASH\n" + sha512 + " f\n",
		"not hex":         "# SHA512 HASH\n" + strings.Repeat("g", 128) + "  f\n",
		"short sha512":    "# SHA512 HASH\n" + strings.Repeat("a", 127) + "  f\n",
		"wrong md5":       "# MD5 HASH\n" + sha512 + "  f\n",
		"path":            "# SHA512 HASH\n" + sha512 + "  dir/f\n",
		"no name":         "# SHA512 HASH\n" + sha512 + "  \n",
		"conflict":        "# SHA512 HASH\n" + sha512 + "  f\n" + strings.Repeat("1", 128) + "  f\n",
		"garbage":         "# SHA512 HASH\nhello world\n",
		"signature block": "-----BEGIN PGP SIGNATURE-----\n",
	} {
		if _, err := ParseDigests([]byte(bad)); !errors.Is(err, ErrVerify) {
			t.Errorf("%s: ParseDigests = %v, want ErrVerify", name, err)
		}
	}
}

// FuzzParseDigests checks that ParseDigests never panics, fails only with
// ErrVerify, returns only well-formed digests, and that what it accepts
// reads back the same when written out again.
func FuzzParseDigests(f *testing.F) {
	f.Add([]byte("# MD5 HASH\n" + strings.Repeat("a", 32) + "  flatcar-container.tar.gz\n# SHA512 HASH\n" +
		strings.Repeat("0", 128) + "  flatcar-container.tar.gz\n"))
	f.Add([]byte("# BLAKE2B HASH\nabcd *x\n\n"))
	f.Add([]byte("# SHA512 HASH\r\n" + strings.Repeat("f", 128) + "  a b\r\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		d, err := ParseDigests(in)
		if err != nil {
			if d != nil || !errors.Is(err, ErrVerify) {
				t.Fatalf("ParseDigests = %v, %v", d, err)
			}
			return
		}
		var out strings.Builder
		for algo, files := range d {
			if l, ok := digestLengths[algo]; ok {
				for _, sum := range files {
					if len(sum) != l {
						t.Fatalf("%s digest %q accepted", algo, sum)
					}
				}
			}
			out.WriteString("# " + algo + " HASH\n")
			for name, sum := range files {
				if sum != strings.ToLower(sum) || name == "" || strings.Contains(name, "/") {
					t.Fatalf("accepted %q for %q", sum, name)
				}
				out.WriteString(sum + "  " + name + "\n")
			}
		}
		again, err := ParseDigests([]byte(out.String()))
		if err != nil {
			t.Fatalf("re-parse %q: %v", out.String(), err)
		}
		if len(again) != len(d) {
			t.Fatalf("re-parse: %v, want %v", again, d)
		}
		for algo, files := range d {
			for name, sum := range files {
				if again[algo][name] != sum {
					t.Fatalf("re-parse: %s %s = %q, want %q", algo, name, again[algo][name], sum)
				}
			}
		}
	})
}
