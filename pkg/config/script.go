package config

import (
	"flag"
	"fmt"
	"io"
	"strings"
)

// ScriptFlags are the options of NVIDIA's nvidia-driver script that have no setting of their own
// here; the gpu-operator's driver.args may pass them. -m/--max-threads is --max-threads.
type ScriptFlags struct {
	AcceptLicense bool   // -a/--accept-license: nvidia-installer's licence prompt; nothing to accept here
	Kernel        string // -k/--kernel KVER: the kernel to install for (the script's KERNEL_VERSION)
	Sign          string // -s/--sign KEYID: sign the modules with that key
	Tag           string // -t/--tag TAG: the script's PACKAGE_TAG (builtin skips the package cache update)
}

// The script's short options, and those of them that take a value.
const (
	scriptShort      = "amkst"
	scriptShortValue = "mkst"
)

// registerScriptFlags adds the script's names to fs: -m shares maxThreads with --max-threads, the
// others fill c.Script.
func registerScriptFlags(fs *flag.FlagSet, s *ScriptFlags, maxThreads flag.Value) {
	fs.Var(maxThreads, "m", "NVIDIA's script's -m: --max-threads")
	fs.BoolVar(&s.AcceptLicense, "a", false, "NVIDIA's script's -a/--accept-license: accepted, nothing to accept")
	fs.BoolVar(&s.AcceptLicense, "accept-license", false, "see -a")
	for _, f := range []struct {
		short, long string
		dst         *string
	}{{"k", "kernel", &s.Kernel}, {"s", "sign", &s.Sign}, {"t", "tag", &s.Tag}} {
		fs.StringVar(f.dst, f.short, "", "NVIDIA's script's -"+f.short+"/--"+f.long)
		fs.StringVar(f.dst, f.long, "", "see -"+f.short)
	}
}

// Notes are the warnings the script's options call for: what each means here and what replaces
// it. running is the running kernel's release.
func (s ScriptFlags) Notes(running string) []string {
	var notes []string
	if s.Kernel != "" && s.Kernel != running {
		notes = append(notes, fmt.Sprintf("-k/--kernel %s ignored: the agent installs for the running kernel (%s); to build a package for another kernel, use driver-agent build --kernel-build-tree DIR at image build", s.Kernel, orNone(running)))
	}
	if s.Sign != "" {
		notes = append(notes, fmt.Sprintf("-s/--sign %s ignored: the agent does not sign modules; sign them when the image's precompiled packages are made (their detached signatures are re-attached on the node) and set --require-signed to refuse unsigned modules", s.Sign))
	}
	if s.Tag != "" {
		notes = append(notes, fmt.Sprintf("-t/--tag %s ignored: the agent runs no package manager and matches precompiled packages by the kernel banner, not by a tag", s.Tag))
	}
	return notes
}

func orNone(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// expandScriptShort rewrites getopt's short forms of the script's options, which the flag
// package does not read: "-m4" becomes "-m 4", "-am 4" becomes "-a -m 4". Arguments that are
// flags here (-max-threads, -sys, ...) and values of flags are left alone; parsing stops at "--"
// and at the first argument that is not a flag, as the flag package does.
func expandScriptShort(args []string, isFlag, isBool func(name string) bool) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" || a == "-" || !strings.HasPrefix(a, "-") {
			return append(out, args[i:]...)
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if isFlag(name) || strings.HasPrefix(a, "--") {
			out = append(out, a)
			if isFlag(name) && !hasValue && !isBool(name) && i+1 < len(args) {
				i++
				out = append(out, args[i])
			}
			continue
		}
		words, needsValue, ok := splitCluster(a[1:])
		if !ok {
			out = append(out, a) // the flag package reports it
			continue
		}
		out = append(out, words...)
		if needsValue && i+1 < len(args) {
			i++
			out = append(out, args[i])
		}
	}
	return out
}

// splitCluster splits getopt's cluster of the script's short options ("am4", "k6.1.0"): flags
// without a value, then at most one with its value attached or, when needsValue, in the next
// argument.
func splitCluster(s string) (words []string, needsValue, ok bool) {
	if s == "" {
		return nil, false, false
	}
	for i := 0; i < len(s); i++ {
		c := s[i : i+1]
		if !strings.Contains(scriptShort, c) {
			return nil, false, false
		}
		words = append(words, "-"+c)
		if strings.Contains(scriptShortValue, c) {
			if rest := s[i+1:]; rest != "" {
				return append(words, rest), false, true
			}
			return words, true, true
		}
	}
	return words, false, true
}

// scriptUsage writes the script's options for the help text.
func scriptUsage(w io.Writer) {
	fmt.Fprintf(w, "\nThe options of NVIDIA's driver-container script, accepted for the gpu-operator's driver.args:\n")
	fmt.Fprintf(w, "  -a, --accept-license\taccepted; there is no licence prompt to answer\n")
	fmt.Fprintf(w, "  -m, --max-threads N\tthe same as --max-threads\n")
	fmt.Fprintf(w, "  -k, --kernel KVER\tthe running kernel is always used; another one is warned about\n")
	fmt.Fprintf(w, "  -s, --sign KEYID\twarned about: modules are not signed here (see --require-signed)\n")
	fmt.Fprintf(w, "  -t, --tag TAG\twarned about: no package manager runs here\n")
}
