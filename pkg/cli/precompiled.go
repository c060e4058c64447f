package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/precompiled"
)

// Exit codes of `driver-agent precompiled`.
const (
	pcOK       = 0
	pcFailed   = 1 // match: the package does not match; other commands: a failure other than a bad package
	pcBadInput = 2 // usage error, or a package that cannot be read or is corrupt
)

func precompiledUsage(w io.Writer, prog string) {
	fmt.Fprintf(w, `Usage: %[1]s precompiled <command> [options]

Read and write NVIDIA precompiled kernel-interface packages (the format of
NVIDIA's mkprecompiled and nvidia-installer).

Commands:
  info [--json] PKG
        print the header and every member (--json: machine-readable)
  match PKG [--proc DIR] [-v]
        compare the package's proc version with the first line of DIR/version
        (default /proc); prints "kernel interface matches." and exits 0, or
        "kernel interface doesn't match." and exits 1; -v says why not.
        (mkprecompiled --match exits 1 on a match; this is the other way round.)
  unpack PKG -o DIR
        write every member to DIR/<target directory>/<name>
  pack PKG [header options] member...
        create PKG, or append to it when it exists (its header is then kept)
        header options (new packages only):
          --driver-version V (-v)     required
          --description D (-d)
          --proc-version S (-P)       the proc version string, exactly as given
          --proc-mount-point DIR      read it from DIR/version (default /proc)
        members, each followed by its own options:
          --kernel-interface FILE --linked-module-name NAME --core-object-name NAME
              [--linked-module FILE --signed-module FILE] [--target-directory DIR]
          --kernel-module FILE [--signed] [--target-directory DIR]

Exit codes: 0 success (or match), 1 no match (match) or an unusable input file
(pack), 2 usage error or an unreadable or corrupt package.
`, prog)
}

// runPrecompiled runs `driver-agent precompiled ...`.
func runPrecompiled(prog string, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		precompiledUsage(stderr, prog)
		return pcBadInput
	}
	cmd, args := args[0], args[1:]
	pc := &pcCommand{prog: prog, name: cmd, stdout: stdout, stderr: stderr}
	switch cmd {
	case "info":
		return pc.info(args)
	case "match":
		return pc.match(args)
	case "unpack":
		return pc.unpack(args)
	case "pack":
		return pc.pack(args)
	case "help", "-h", "-help", "--help":
		precompiledUsage(stdout, prog)
		return pcOK
	}
	fmt.Fprintf(stderr, "%s precompiled: unknown command %q\n\n", prog, cmd)
	precompiledUsage(stderr, prog)
	return pcBadInput
}

// pcCommand is one run of a precompiled subcommand.
type pcCommand struct {
	prog, name     string
	stdout, stderr io.Writer
}

// fail prints a one-line error and returns code.
func (c *pcCommand) fail(code int, format string, args ...any) int {
	fmt.Fprintf(c.stderr, "%s precompiled %s: %s\n", c.prog, c.name, fmt.Sprintf(format, args...))
	return code
}

// usageError prints an error and the usage hint and returns pcBadInput.
func (c *pcCommand) usageError(format string, args ...any) int {
	c.fail(pcBadInput, format, args...)
	fmt.Fprintf(c.stderr, "Run '%s precompiled help' for usage.\n", c.prog)
	return pcBadInput
}

// flags parses args with fs, allowing options before and after the
// positional arguments, and checks that exactly one positional (the package)
// is given. ok is false when the command should stop with code.
func (c *pcCommand) flags(fs *flag.FlagSet, args []string) (pkg string, code int, ok bool) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				precompiledUsage(c.stdout, c.prog)
				return "", pcOK, false
			}
			return "", c.usageError("%v", err), false
		}
		rest := fs.Args()
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		if len(rest) == 0 {
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	switch len(pos) {
	case 0:
		return "", c.usageError("no package file given"), false
	case 1:
		return pos[0], 0, true
	}
	return "", c.usageError("one package file expected, got %q", pos), false
}

// load reads and parses the package at path; the error names the file once.
func load(path string) (*precompiled.Package, error) {
	f, err := os.Open(path)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	p, err := precompiled.Read(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return p, nil
}

func (c *pcCommand) loadOrFail(path string) (*precompiled.Package, int) {
	p, err := load(path)
	if err != nil {
		return nil, c.fail(pcBadInput, "cannot use package %v", err)
	}
	return p, pcOK
}

func (c *pcCommand) info(args []string) int {
	fs := flag.NewFlagSet("info", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "")
	path, code, ok := c.flags(fs, args)
	if !ok {
		return code
	}
	p, code := c.loadOrFail(path)
	if p == nil {
		return code
	}
	write := precompiled.Info
	if *asJSON {
		write = precompiled.InfoJSON
	}
	if err := write(c.stdout, p); err != nil {
		return c.fail(pcFailed, "%v", err)
	}
	return pcOK
}

func (c *pcCommand) match(args []string) int {
	fs := flag.NewFlagSet("match", flag.ContinueOnError)
	proc := fs.String("proc", "/proc", "")
	fs.StringVar(proc, "proc-mount-point", "/proc", "") // mkprecompiled's name
	verbose := fs.Bool("v", false, "")
	path, code, ok := c.flags(fs, args)
	if !ok {
		return code
	}
	p, code := c.loadOrFail(path)
	if p == nil {
		return code
	}
	banner, err := precompiled.ReadBanner(*proc)
	if err != nil {
		return c.fail(pcBadInput, "cannot read the running kernel's proc version: %v", err)
	}
	if precompiled.Match(p, banner) {
		fmt.Fprintln(c.stdout, "kernel interface matches.")
		return pcOK
	}
	fmt.Fprintln(c.stdout, "kernel interface doesn't match.")
	if *verbose {
		fmt.Fprint(c.stdout, precompiled.Explain(p.ProcVersion, banner))
	}
	return pcFailed
}

func (c *pcCommand) unpack(args []string) int {
	fs := flag.NewFlagSet("unpack", flag.ContinueOnError)
	out := fs.String("o", "", "")
	fs.StringVar(out, "output", "", "")
	path, code, ok := c.flags(fs, args)
	if !ok {
		return code
	}
	if *out == "" {
		return c.usageError("no output directory given (-o DIR)")
	}
	p, code := c.loadOrFail(path)
	if p == nil {
		return code
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return c.fail(pcFailed, "%v", err)
	}
	if _, err := precompiled.Unpack(p, *out); err != nil {
		return c.fail(pcFailed, "%v", err)
	}
	return pcOK
}

// packMember is one --kernel-interface or --kernel-module with its options.
type packMember struct {
	opt                  string // the option that introduced it
	path                 string
	interfaceMember      bool
	linkedName, coreName string
	linked, signed       string
	targetDir            string
	embeddedSig          bool
	set                  map[string]bool // per-member options given
}

// packArgs is a parsed pack command line.
type packArgs struct {
	pkg                                  string
	driverVersion, description, procVer  string
	procMount                            string
	hasVersion, hasDesc, hasProc, hasDir bool
	members                              []*packMember
}

// packOption returns the canonical name of one of pack's options that take a
// value; "-v", "-d" and "-P" are mkprecompiled's short forms.
func packOption(name string) (string, bool) {
	switch name {
	case "-v":
		return "--driver-version", true
	case "-d":
		return "--description", true
	case "-P":
		return "--proc-version", true
	case "--driver-version", "--description", "--proc-version", "--proc-mount-point",
		"--kernel-interface", "--kernel-module", "--linked-module-name", "--core-object-name",
		"--linked-module", "--signed-module", "--target-directory":
		return name, true
	}
	return "", false
}

// parsePack parses pack's order-sensitive command line.
func parsePack(args []string) (*packArgs, error) {
	a := &packArgs{}
	var cur *packMember
	for i := 0; i < len(args); i++ {
		arg := args[i]
		if !strings.HasPrefix(arg, "-") || arg == "-" {
			if a.pkg != "" {
				return nil, fmt.Errorf("unexpected argument %q (the package is %q)", arg, a.pkg)
			}
			a.pkg = arg
			continue
		}
		if arg == "--signed" {
			if cur == nil || cur.interfaceMember {
				return nil, errors.New("--signed must follow a --kernel-module")
			}
			cur.embeddedSig = true
			continue
		}
		name, value, hasValue := strings.Cut(arg, "=")
		opt, known := packOption(name)
		if !known {
			return nil, fmt.Errorf("unknown option %s", name)
		}
		if !hasValue {
			if i+1 >= len(args) {
				return nil, fmt.Errorf("%s needs a value", name)
			}
			i++
			value = args[i]
		}
		switch opt {
		case "--driver-version":
			a.driverVersion, a.hasVersion = value, true
		case "--description":
			a.description, a.hasDesc = value, true
		case "--proc-version":
			a.procVer, a.hasProc = value, true
		case "--proc-mount-point":
			a.procMount, a.hasDir = value, true
		case "--kernel-interface", "--kernel-module":
			cur = &packMember{opt: opt, path: value, interfaceMember: opt == "--kernel-interface", set: map[string]bool{}}
			a.members = append(a.members, cur)
		default:
			if cur == nil {
				return nil, fmt.Errorf("%s must follow a --kernel-interface or --kernel-module", opt)
			}
			if cur.set[opt] {
				return nil, fmt.Errorf("%s given twice for %s", opt, cur.path)
			}
			cur.set[opt] = true
			switch opt {
			case "--target-directory":
				cur.targetDir = value
				continue
			case "--linked-module-name":
				cur.linkedName = value
			case "--core-object-name":
				cur.coreName = value
			case "--linked-module":
				cur.linked = value
			case "--signed-module":
				cur.signed = value
			}
			if !cur.interfaceMember {
				return nil, fmt.Errorf("%s must follow a --kernel-interface, not a --kernel-module", opt)
			}
		}
	}
	switch {
	case a.pkg == "":
		return nil, errors.New("no package file given")
	case len(a.members) == 0:
		return nil, errors.New("nothing to pack: give --kernel-interface or --kernel-module")
	case a.hasProc && a.hasDir:
		return nil, errors.New("give --proc-version or --proc-mount-point, not both")
	}
	for _, m := range a.members {
		if !m.interfaceMember {
			continue
		}
		if m.linkedName == "" || m.coreName == "" {
			return nil, fmt.Errorf("--kernel-interface %s needs --linked-module-name and --core-object-name", m.path)
		}
		if (m.linked == "") != (m.signed == "") {
			return nil, fmt.Errorf("--kernel-interface %s: give --linked-module and --signed-module together", m.path)
		}
	}
	return a, nil
}

func (c *pcCommand) pack(args []string) int {
	for _, arg := range args {
		if arg == "-h" || arg == "--help" || arg == "-help" {
			precompiledUsage(c.stdout, c.prog)
			return pcOK
		}
	}
	a, err := parsePack(args)
	if err != nil {
		return c.usageError("%v", err)
	}
	var p *precompiled.Package
	if _, err := os.Stat(a.pkg); err == nil {
		// Like mkprecompiled: an existing package keeps its header and gets
		// the new members appended.
		if p, err = load(a.pkg); err != nil {
			return c.fail(pcBadInput, "cannot append to package %v", err)
		}
		var ignored []string
		for _, o := range []struct {
			given bool
			name  string
		}{{a.hasVersion, "--driver-version"}, {a.hasDesc, "--description"}, {a.hasProc, "--proc-version"}, {a.hasDir, "--proc-mount-point"}} {
			if o.given {
				ignored = append(ignored, o.name)
			}
		}
		if len(ignored) > 0 {
			fmt.Fprintf(c.stderr, "%s precompiled pack: %s exists: appending to it and keeping its header; ignoring %s\n",
				c.prog, a.pkg, strings.Join(ignored, ", "))
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return c.fail(pcBadInput, "cannot use package %v", err)
	} else {
		if a.driverVersion == "" {
			return c.usageError("a new package needs --driver-version")
		}
		proc := a.procVer
		if !a.hasProc {
			dir := a.procMount
			if dir == "" {
				dir = "/proc"
			}
			if proc, err = precompiled.ReadBanner(dir); err != nil {
				return c.fail(pcFailed, "proc version: %v", err)
			}
		}
		p = &precompiled.Package{DriverVersion: a.driverVersion, Description: a.description, ProcVersion: proc}
	}
	for _, m := range a.members {
		var err error
		if m.interfaceMember {
			err = p.AddKernelInterface(m.path, m.linkedName, m.coreName, m.targetDir, m.linked, m.signed)
		} else {
			err = p.AddKernelModule(m.path, m.targetDir, m.embeddedSig)
		}
		if err != nil {
			return c.fail(pcFailed, "%s %s: %v", m.opt, m.path, err)
		}
	}
	b, err := p.Marshal()
	if err != nil {
		return c.fail(pcFailed, "%v", err)
	}
	if err := host.WriteAtomic(a.pkg, b, 0o644); err != nil {
		return c.fail(pcFailed, "%v", err)
	}
	return pcOK
}
