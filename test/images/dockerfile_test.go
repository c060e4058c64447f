package images

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

const repo = "../.."

// dockerfile is a parsed Dockerfile with every instruction expanded for one set of build
// arguments, as BuildKit would see it.
type dockerfile struct {
	name   string
	meta   map[string]*string // global ARGs and their defaults (nil: none)
	stages []instructions.Stage
	env    []map[string]string // per stage: the ARG and ENV values after its last instruction
}

// parseDockerfile parses name with BuildKit's parser and instruction parser, fails the test on
// parser or linter warnings, and expands every instruction with buildArgs (the BuildKit
// platform arguments included).
func parseDockerfile(t *testing.T, name string, buildArgs map[string]string) dockerfile {
	t.Helper()
	f, err := os.Open(filepath.Join(repo, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	for _, w := range res.Warnings {
		t.Errorf("%s: parser warning: %s", name, w.Short)
	}
	lint := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		t.Errorf("%s:%d: lint %s: %s", name, line, rule, msg)
	}})
	stages, metaArgs, err := instructions.Parse(res.AST, lint)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	d := dockerfile{name: name, meta: map[string]*string{}, stages: stages}
	lex := shell.NewLex(res.EscapeToken)
	global := map[string]string{}
	for k, v := range buildArgs {
		global[k] = v
	}
	for _, a := range metaArgs {
		for _, kv := range a.Args {
			d.meta[kv.Key] = kv.Value
			if _, given := buildArgs[kv.Key]; !given && kv.Value != nil {
				global[kv.Key] = *kv.Value
			}
		}
	}
	for i := range d.stages {
		st := &d.stages[i]
		base, _, err := lex.ProcessWord(st.BaseName, envOf(global))
		if err != nil {
			t.Fatalf("%s: FROM %s: %v", name, st.BaseName, err)
		}
		st.BaseName = base
		env := map[string]string{}
		expand := func(word string) (string, error) {
			s, _, err := lex.ProcessWord(word, envOf(env))
			return s, err
		}
		for _, c := range st.Commands {
			if e, ok := c.(instructions.SupportsSingleWordExpansion); ok {
				if err := e.Expand(expand); err != nil {
					t.Fatalf("%s: %s: %v", name, c.Name(), err)
				}
			}
			switch c := c.(type) {
			case *instructions.ArgCommand:
				for _, kv := range c.Args {
					switch v, given := buildArgs[kv.Key]; {
					case given:
						env[kv.Key] = v
					case kv.Value != nil:
						env[kv.Key] = *kv.Value
					default:
						env[kv.Key] = global[kv.Key] // a global ARG brought into the stage
					}
				}
			case *instructions.EnvCommand:
				for _, kv := range c.Env {
					env[kv.Key] = kv.Value
				}
			}
		}
		d.env = append(d.env, env)
	}
	return d
}

func envOf(m map[string]string) shell.EnvGetter {
	var kv []string
	for k, v := range m {
		kv = append(kv, k+"="+v)
	}
	return shell.EnvsFromSlice(kv)
}

func (d dockerfile) stage(t *testing.T, name string) (*instructions.Stage, map[string]string) {
	t.Helper()
	for i := range d.stages {
		if d.stages[i].Name == name {
			return &d.stages[i], d.env[i]
		}
	}
	t.Fatalf("%s: no stage %q", d.name, name)
	return nil, nil
}

func (d dockerfile) final() (*instructions.Stage, map[string]string) {
	return &d.stages[len(d.stages)-1], d.env[len(d.stages)-1]
}

func commands[T instructions.Command](st *instructions.Stage) []T {
	var out []T
	for _, c := range st.Commands {
		if c, ok := c.(T); ok {
			out = append(out, c)
		}
	}
	return out
}

// script is a RUN's shell script.
func script(r *instructions.RunCommand) string {
	return strings.Join(r.CmdLine, " ")
}

// runWith finds the RUN whose script contains every needle.
func runWith(t *testing.T, st *instructions.Stage, needles ...string) *instructions.RunCommand {
	t.Helper()
	for _, r := range commands[*instructions.RunCommand](st) {
		s := script(r)
		if !slices.ContainsFunc(needles, func(n string) bool { return !strings.Contains(s, n) }) {
			return r
		}
	}
	t.Fatalf("stage %q: no RUN with %q", st.Name, needles)
	return nil
}

var buildArgs = map[string]string{
	"DRIVER_VERSION": "580.159.04",
	"TARGETARCH":     "amd64",
	"TARGETOS":       "linux",
	"BUILDPLATFORM":  "linux/amd64",
	"TARGETPLATFORM": "linux/amd64",
	"VERSION":        "v1.2.3",
	"REVISION":       "0123abc",
}

func TestBuildStages(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	var got []string
	for _, st := range d.stages {
		got = append(got, fmt.Sprintf("%s:%s:%s", st.Name, st.BaseName, st.Platform))
	}
	want := []string{"agent:golang:1.26:$BUILDPLATFORM", "runfile:ubuntu:24.04:", ":ubuntu:24.04:"}
	if !slices.Equal(got, want) {
		t.Errorf("stages (name:base:platform) %q, want %q", got, want)
	}
	if v := d.meta["BASE_IMAGE"]; v == nil || *v != "ubuntu:24.04" {
		t.Errorf("BASE_IMAGE defaults to %v, want ubuntu:24.04 (what the Flatcar driver images use)", v)
	}
}

// The agent is built by the Makefile's build target, for the target platform, and checked to
// be static; the Makefile's target has the flags a static, reproducible binary needs.
func TestBuildAgentIsStatic(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	agent, _ := d.stage(t, "agent")
	r := runWith(t, agent, "make build")
	s := script(r)
	for _, want := range []string{`GOOS="$TARGETOS"`, `GOARCH="$TARGETARCH"`, `VERSION="$VERSION"`, "BIN=/out", "readelf -l /out/driver-agent", "INTERP"} {
		if !strings.Contains(s, want) {
			t.Errorf("agent build %q lacks %q", s, want)
		}
	}
	mk, err := os.ReadFile(filepath.Join(repo, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	recipe := makeRecipe(t, string(mk), "build")
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", `-ldflags "$(LDFLAGS)"`, "-o $(BIN)/driver-agent ./cmd/driver-agent"} {
		if !strings.Contains(recipe, want) {
			t.Errorf("Makefile build recipe %q lacks %q", recipe, want)
		}
	}
	if !strings.Contains(string(mk), "LDFLAGS   := -s -w -X $(PKG)/pkg/cli.version=$(VERSION)") {
		t.Error("Makefile LDFLAGS no longer strip the binary and set the version")
	}
}

// makeRecipe returns the recipe lines of target.
func makeRecipe(t *testing.T, mk, target string) string {
	t.Helper()
	var lines []string
	in := false
	for l := range strings.SplitSeq(mk, "\n") {
		switch {
		case strings.HasPrefix(l, target+":"):
			in = true
		case in && strings.HasPrefix(l, "\t"):
			lines = append(lines, strings.TrimSpace(l))
		case in:
			in = false
		}
	}
	if len(lines) == 0 {
		t.Fatalf("Makefile has no %s target", target)
	}
	return strings.Join(lines, "\n")
}

func TestBuildFinalStage(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	final, env := d.final()

	// The static binary from the agent stage, and nothing else from it.
	var fromAgent []string
	agentAt := -1
	for i, c := range final.Commands {
		if cp, ok := c.(*instructions.CopyCommand); ok && cp.From == "agent" {
			fromAgent = append(fromAgent, strings.Join(cp.SourcePaths, ",")+" -> "+cp.DestPath)
			agentAt = i
		}
	}
	if want := []string{"/out/driver-agent -> /usr/local/bin/driver-agent"}; !slices.Equal(fromAgent, want) {
		t.Errorf("copied from the agent stage: %q, want %q", fromAgent, want)
	}

	// nvidia-driver is a relative symlink to it, made after the copy.
	var link []string
	for i, c := range final.Commands {
		r, ok := c.(*instructions.RunCommand)
		if !ok || !strings.HasPrefix(script(r), "ln ") {
			continue
		}
		if i < agentAt {
			t.Errorf("the symlink is made before the binary is copied")
		}
		link = strings.Fields(script(r))
	}
	if want := []string{"ln", "-s", "driver-agent", "/usr/local/bin/nvidia-driver"}; !slices.Equal(link, want) {
		t.Errorf("symlink RUN %q, want %q", link, want)
	} else if target := filepath.Join(filepath.Dir(link[3]), link[2]); target != "/usr/local/bin/driver-agent" {
		t.Errorf("nvidia-driver points at %s", target)
	}

	eps := commands[*instructions.EntrypointCommand](final)
	if len(eps) != 1 || eps[0].PrependShell || !slices.Equal(eps[0].CmdLine, []string{"nvidia-driver", "init"}) {
		t.Errorf(`ENTRYPOINT %+v, want exec form ["nvidia-driver", "init"]`, eps)
	}
	if len(commands[*instructions.CmdCommand](final)) != 0 {
		t.Error("a CMD would be appended to nvidia-driver init")
	}

	for k, want := range map[string]string{"NVIDIA_VISIBLE_DEVICES": "void", "DRIVER_VERSION": "580.159.04"} {
		if env[k] != want {
			t.Errorf("ENV %s=%q, want %q", k, env[k], want)
		}
	}
	var envs []string
	for _, e := range commands[*instructions.EnvCommand](final) {
		for _, kv := range e.Env {
			envs = append(envs, kv.Key)
		}
	}
	if !slices.Contains(envs, "NVIDIA_VISIBLE_DEVICES") || !slices.Contains(envs, "DRIVER_VERSION") {
		t.Errorf("ENV instructions set %q", envs)
	}

	labels := map[string]string{}
	for _, l := range commands[*instructions.LabelCommand](final) {
		for _, kv := range l.Labels {
			labels[kv.Key] = kv.Value
		}
	}
	for _, k := range []string{"title", "description", "source", "version", "revision", "base.name"} {
		if labels["org.opencontainers.image."+k] == "" {
			t.Errorf("no OCI label org.opencontainers.image.%s", k)
		}
	}
	if labels["org.opencontainers.image.version"] != "v1.2.3" || labels["org.opencontainers.image.revision"] != "0123abc" ||
		labels["org.opencontainers.image.base.name"] != "ubuntu:24.04" {
		t.Errorf("labels not expanded from the build arguments: %v", labels)
	}
}

// NVIDIA's userspace, kernel sources, fabric manager and the toolchain.
func TestBuildDriverContents(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	final, env := d.final()

	var src []string
	for _, cp := range commands[*instructions.CopyCommand](final) {
		if cp.From == "runfile" {
			src = append(src, strings.Join(cp.SourcePaths, ",")+" -> "+cp.DestPath)
		}
	}
	want := []string{
		"/drivers/NVIDIA-Linux/kernel -> /usr/src/nvidia-580.159.04/kernel",
		"/drivers/NVIDIA-Linux/kernel-open -> /usr/src/nvidia-580.159.04/kernel-open",
		"/drivers/NVIDIA-Linux/LICENSE,/drivers/NVIDIA-Linux/mkprecompiled -> /usr/src/nvidia-580.159.04/",
		"/drivers/NVIDIA-Linux/supported-gpus -> /usr/src/nvidia-580.159.04/supported-gpus",
	}
	if !slices.Equal(src, want) {
		t.Errorf("kernel sources copied: %q, want %q", src, want)
	}

	// The userspace install: nvidia-installer from the extracted .run, with every option of
	// NVIDIA's script, run from a bind mount so the .run leaves no layer behind.
	inst := runWith(t, final, "./nvidia-installer")
	s := script(inst)
	for _, opt := range []string{"--silent", "--no-kernel-module", "--no-nouveau-check", "--no-nvidia-modprobe",
		"--no-rpms", "--no-backup", "--no-check-for-alternate-installs", "--no-libglx-indirect", "--no-install-libglvnd",
		"--x-prefix=/tmp/null", "--x-module-path=/tmp/null", "--x-library-path=/tmp/null", "--x-sysconfig-path=/tmp/null"} {
		if !slices.Contains(strings.Fields(strings.ReplaceAll(s, ";", " ")), opt) {
			t.Errorf("nvidia-installer lacks %s", opt)
		}
	}
	for _, want := range []string{"command -v nvidia-smi", "cp -al \"$fw\" \"/usr/share/driver-agent/firmware/nvidia/$DRIVER_VERSION\""} {
		if !strings.Contains(s, want) {
			t.Errorf("userspace RUN lacks %q", want)
		}
	}
	mounts := instructions.GetMounts(inst)
	if len(mounts) != 1 || mounts[0].From != "runfile" || mounts[0].Source != "/drivers/NVIDIA-Linux" || mounts[0].ReadOnly {
		t.Errorf("nvidia-installer mounts %+v, want a writable bind of runfile:/drivers/NVIDIA-Linux", mounts)
	}

	// gcc of the Flatcar kernel's major version, also as gcc and cc.
	if env["GCC_MAJOR"] != "14" {
		t.Errorf("GCC_MAJOR=%q, want 14 (Flatcar's kernels are built with gcc 14)", env["GCC_MAJOR"])
	}
	tools := strings.Fields(script(runWith(t, final, "apt-get install")))
	for _, pkg := range []string{`"gcc-${GCC_MAJOR}"`, "make", "binutils", "libelf-dev", "patchelf", "ca-certificates", "kmod", "squashfs-tools"} {
		if !slices.Contains(tools, pkg) {
			t.Errorf("toolchain lacks %s: %s", pkg, tools)
		}
	}
	for _, alt := range []string{`/usr/bin/gcc gcc "/usr/bin/gcc-${GCC_MAJOR}"`, "/usr/bin/cc cc /usr/bin/gcc"} {
		if !strings.Contains(strings.Join(tools, " "), "update-alternatives --install "+alt) {
			t.Errorf("no alternative %s", alt)
		}
	}
}

// fakeTools writes shell scripts named after each tool into a directory: each logs its name
// and arguments to log, then runs its body.
func fakeTools(t *testing.T, log string, tools map[string]string) string {
	t.Helper()
	bin := t.TempDir()
	for name, body := range tools {
		s := fmt.Sprintf("#!/bin/sh\necho \"%s $*\" >> %q\n%s\n", name, log, body)
		if err := os.WriteFile(filepath.Join(bin, name), []byte(s), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return bin
}

// runScript runs a RUN's script with sh -f -c (no pathname expansion: globs reach the fake
// tools as written), PATH set to bin only, and env.
func runScript(t *testing.T, s, bin string, env map[string]string) (string, error) {
	t.Helper()
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(sh, "-f", "-c", s)
	cmd.Env = []string{"PATH=" + bin}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// The fabric manager step, run with fake apt tools: the right package names per branch,
// pinned to the driver version and held.
func TestBuildFabricManagerPins(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	final, _ := d.final()
	fm := runWith(t, final, "nvidia-fabricmanager")
	if m := instructions.GetMounts(fm); len(m) != 1 || m[0].From != "runfile" || m[0].Source != "/drivers/cuda-keyring.deb" {
		t.Errorf("fabric manager step mounts %+v, want the CUDA keyring from runfile", m)
	}
	tests := []struct {
		version string
		want    []string
	}{
		{"580.159.04", []string{
			"dpkg -i /tmp/cuda-keyring.deb",
			"apt-get update",
			"apt-get install -y --no-install-recommends nvidia-fabricmanager=580.159.04-1 libnvidia-nscq=580.159.04-1 nvlsm infiniband-diags",
			"apt-mark hold nvidia-fabricmanager libnvidia-nscq",
			"rm -f /etc/apt/sources.list.d/cuda*",
			"rm -rf /var/lib/apt/lists/*",
		}},
		{"570.195.03", []string{
			"dpkg -i /tmp/cuda-keyring.deb",
			"apt-get update",
			"apt-get install -y --no-install-recommends nvidia-fabricmanager-570=570.195.03-1 libnvidia-nscq-570=570.195.03-1 nvlsm infiniband-diags",
			"apt-mark hold nvidia-fabricmanager-570 libnvidia-nscq-570",
			"rm -f /etc/apt/sources.list.d/cuda*",
			"rm -rf /var/lib/apt/lists/*",
		}},
		{"550.163.01", []string{
			"dpkg -i /tmp/cuda-keyring.deb",
			"apt-get update",
			"apt-get install -y --no-install-recommends nvidia-fabricmanager-550=550.163.01-1 libnvidia-nscq-550=550.163.01-1",
			"apt-mark hold nvidia-fabricmanager-550 libnvidia-nscq-550",
			"rm -f /etc/apt/sources.list.d/cuda*",
			"rm -rf /var/lib/apt/lists/*",
		}},
	}
	for _, tt := range tests {
		log := filepath.Join(t.TempDir(), "log")
		bin := fakeTools(t, log, map[string]string{"dpkg": "", "apt-get": "", "apt-mark": "", "rm": ""})
		out, err := runScript(t, script(fm), bin, map[string]string{"DRIVER_VERSION": tt.version, "TARGETARCH": "amd64"})
		if err != nil {
			t.Fatalf("%s: %v\n%s", tt.version, err, out)
		}
		b, err := os.ReadFile(log)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Split(strings.TrimSpace(string(b)), "\n"); !slices.Equal(got, tt.want) {
			t.Errorf("driver %s ran\n%s\nwant\n%s", tt.version, strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
		}
	}
}

func TestPrecompiledStages(t *testing.T) {
	args := map[string]string{"BASE": "registry.example/driver:580.159.04-flatcar", "FLATCAR_VERSION": "4593.2.0", "TARGETARCH": "amd64"}
	d := parseDockerfile(t, "Dockerfile.precompiled", args)
	if v, ok := d.meta["BASE"]; !ok || v != nil {
		t.Errorf("global ARG BASE: declared %v, default %v; want declared without a default (the build image must be named)", ok, v)
	}
	var got []string
	for _, st := range d.stages {
		got = append(got, st.Name+":"+st.BaseName)
	}
	if want := []string{"builder:" + args["BASE"], ":" + args["BASE"]}; !slices.Equal(got, want) {
		t.Errorf("stages %q, want %q", got, want)
	}
	builder, env := d.stage(t, "builder")
	if env["FLATCAR_VERSION"] != "4593.2.0" {
		t.Errorf("builder sees FLATCAR_VERSION=%q", env["FLATCAR_VERSION"])
	}
	runWith(t, builder, "driver-agent fetch-build-tree", "driver-agent banner --vmlinuz", "driver-agent build", "--kernel-banner", "--kernel-build-tree")

	// The final stage adds the builder's /out and labels, nothing else: no RUN can link a
	// module, no COPY brings in anything but the packages, and the entrypoint is the base's.
	final, _ := d.final()
	for _, c := range final.Commands {
		switch c := c.(type) {
		case *instructions.CopyCommand:
			if c.From != "builder" || !slices.Equal(c.SourcePaths, []string{"/out/"}) || c.DestPath != "/" {
				t.Errorf("final stage copies %q from %q to %s; want only builder:/out/ to /", c.SourcePaths, c.From, c.DestPath)
			}
			for _, p := range c.SourcePaths {
				if strings.Contains(p, ".ko") {
					t.Errorf("final stage copies a kernel module: %s", p)
				}
			}
		case *instructions.LabelCommand, *instructions.ArgCommand:
		default:
			t.Errorf("final stage has %s; it may only copy the packages and label the image", c.Name())
		}
	}
}

// The builder's script, run with a fake driver-agent and its work and output directories moved
// into a temporary directory: it derives the channel and board, reads the banner from the
// kernel image, builds one package per flavour named after the kernel, checks each against the
// banner, and leaves only the packages in /out.
func TestPrecompiledBuilderScript(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.precompiled", map[string]string{"BASE": "b", "TARGETARCH": "arm64"})
	builder, env := d.stage(t, "builder")
	s := script(runWith(t, builder, "fetch-build-tree"))
	if env["FLAVORS"] != "kernel kernel-open" {
		t.Errorf("FLAVORS defaults to %q", env["FLAVORS"])
	}

	const banner = "Linux version 6.12.81-flatcar (build@pony-truck.infra.kinvolk.io) (x86_64-cros-linux-gnu-gcc (Gentoo Hardened 14.2.1_p20241221 p7) 14.2.1 20241221, GNU ld (Gentoo 2.44 p1) 2.44.0) #1 SMP PREEMPT_DYNAMIC Mon Sep  1 18:03:04 -00 2025"
	agent := `
case "$1" in
fetch-build-tree)
  while [ $# -gt 0 ]; do [ "$1" = -o ] && o=$2; shift; done
  mkdir -p "$o/build/scripts" && echo elf > "$o/build/scripts/modpost" && echo kernel > "$o/flatcar_production_image.vmlinuz" ;;
banner)
  [ "$2" = --vmlinuz ] && [ -f "$3" ] || exit 3
  echo "` + banner + `" ;;
build)
  while [ $# -gt 0 ]; do [ "$1" = -o ] && o=$2; shift; done
  echo package > "$o" ;;
precompiled)
  [ "$2" = info ] && exit 0
  [ "$2" = match ] && [ "$4" = --proc ] && [ "$(cat "$5/version")" = "` + banner + `" ] || exit 1 ;;
*) exit 2 ;;
esac`
	tools := map[string]string{"driver-agent": agent}
	for _, tool := range []string{"cut", "cp", "mkdir", "rm", "cat", "tr"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
		tools[tool] = fmt.Sprintf("exec %s \"$@\"", p)
	}

	tests := []struct {
		name, version, channel, arch string
		flavors                      string
		board, wantErr               string
		packages                     []string
	}{
		{name: "stable arm64", version: "4593.2.0", arch: "arm64", flavors: "kernel kernel-open", board: "arm64-usr --channel stable",
			packages: []string{"kernel-open/precompiled/nvidia-modules-6.12.81", "kernel/precompiled/nvidia-modules-6.12.81"}}, // sorted
		{name: "lts amd64, open only", version: "4081.3.6", arch: "amd64", flavors: "kernel-open", board: "amd64-usr --channel lts",
			packages: []string{"kernel-open/precompiled/nvidia-modules-6.12.81"}},
		{name: "channel given", version: "4593.2.0", channel: "beta", arch: "amd64", flavors: "kernel", board: "amd64-usr --channel beta",
			packages: []string{"kernel/precompiled/nvidia-modules-6.12.81"}},
		{name: "no version", arch: "amd64", flavors: "kernel", wantErr: "set --build-arg FLATCAR_VERSION"},
		{name: "unknown channel", version: "4593.7.0", arch: "amd64", flavors: "kernel", wantErr: "cannot tell the channel"},
		{name: "riscv", version: "4593.2.0", arch: "riscv64", flavors: "kernel", wantErr: "unsupported TARGETARCH riscv64"},
		{name: "bad flavour", version: "4593.2.0", arch: "amd64", flavors: "open", wantErr: "unknown flavour open"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			work, out := filepath.Join(dir, "work"), filepath.Join(dir, "out")
			moved := strings.ReplaceAll(strings.ReplaceAll(s, "/tmp/flatcar", work), "/out/", out+"/")
			if moved == s {
				t.Fatal("the builder no longer uses /tmp/flatcar and /out/")
			}
			log := filepath.Join(dir, "log")
			bin := fakeTools(t, log, tools)
			res, err := runScript(t, moved, bin, map[string]string{
				"FLATCAR_VERSION": tt.version, "FLATCAR_CHANNEL": tt.channel, "TARGETARCH": tt.arch,
				"FLAVORS": tt.flavors, "MAX_THREADS": "", "DRIVER_VERSION": "580.159.04",
			})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(res, tt.wantErr) {
					t.Fatalf("err %v, output %q; want a failure saying %q", err, res, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("%v\n%s", err, res)
			}
			b, _ := os.ReadFile(log)
			calls := string(b)
			if want := "driver-agent fetch-build-tree --flatcar-version " + tt.version + " --board " + tt.board + " -o " + work; !strings.Contains(calls, want) {
				t.Errorf("calls\n%s\nlack %q", calls, want)
			}
			var files []string
			root := filepath.Join(out, "usr/src/nvidia-580.159.04")
			err = filepath.WalkDir(out, func(p string, e os.DirEntry, err error) error {
				if err == nil && !e.IsDir() {
					rel, _ := filepath.Rel(root, p)
					files = append(files, rel)
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(files)
			if !slices.Equal(files, tt.packages) {
				t.Errorf("/out holds %q, want only %q", files, tt.packages)
			}
			for _, p := range tt.packages {
				flavor := strings.Split(p, "/")[0]
				typ := map[string]string{"kernel": "proprietary", "kernel-open": "open"}[flavor]
				want := fmt.Sprintf("driver-agent build --kernel-module-type %s --kernel-banner %s/banner --kernel-build-tree %s/build -o %s", typ, work, work, filepath.Join(root, p))
				if !strings.Contains(calls, want) {
					t.Errorf("calls\n%s\nlack %q", calls, want)
				}
				if !strings.Contains(calls, "driver-agent precompiled match "+filepath.Join(root, p)+" --proc "+work+"/proc") {
					t.Errorf("%s is not checked against the banner", p)
				}
			}
			if _, err := os.Stat(work); !os.IsNotExist(err) {
				t.Errorf("the work directory (build tree, kernel image) is left behind: %v", err)
			}
		})
	}
}

// The runfile stage's download step, run with fake curl, sha256sum and .run and /drivers moved
// into a temporary directory: the right file for each architecture, the checksum checked when
// given, the extracted tree renamed where the final stage copies from, the .run removed.
func TestBuildRunfileScript(t *testing.T) {
	d := parseDockerfile(t, "Dockerfile.build", buildArgs)
	runfile, env := d.stage(t, "runfile")
	s := script(runWith(t, runfile, "curl", "-x"))
	if env["DRIVER_BASE_URL"] != "https://us.download.nvidia.com/tesla" {
		t.Errorf("DRIVER_BASE_URL=%q", env["DRIVER_BASE_URL"])
	}
	tools := map[string]string{
		// curl -fsSL --retry 3 -o FILE URL
		"curl":      `echo "$6" > "$5"`,
		"sha256sum": `cat > /dev/null`,
		// sh NVIDIA-Linux-<arch>-<version>.run -x
		"sh": `[ "$2" = -x ] || exit 9; d=$(basename "$1" .run); mkdir -p "$d/kernel" "$d/kernel-open"
if [ -z "$FAKE_RUN_NO_GPU_LIST" ]; then mkdir -p "$d/supported-gpus"; echo '{"chips":[]}' > "$d/supported-gpus/supported-gpus.json"; fi`,
	}
	for _, tool := range []string{"mkdir", "mv", "rm", "tr", "cat", "basename"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		tools[tool] = fmt.Sprintf("exec %s \"$@\"", p)
	}
	const sum64 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	tests := []struct {
		name, version, arch, sumAMD64 string
		noGPUList                     bool
		wantCalls, wantErr            []string
	}{
		{name: "amd64 checked", version: "580.159.04", arch: "amd64", sumAMD64: sum64,
			wantCalls: []string{
				"curl -fsSL --retry 3 -o NVIDIA-Linux-x86_64-580.159.04.run https://us.download.nvidia.com/tesla/580.159.04/NVIDIA-Linux-x86_64-580.159.04.run",
				"sha256sum -c -",
				"sh NVIDIA-Linux-x86_64-580.159.04.run -x",
				"curl -fsSL --retry 3 -o DRIVERS/cuda-keyring.deb https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/cuda-keyring_1.1-1_all.deb",
			}},
		{name: "arm64 unchecked", version: "595.71.05", arch: "arm64",
			wantCalls: []string{
				"curl -fsSL --retry 3 -o NVIDIA-Linux-aarch64-595.71.05.run https://us.download.nvidia.com/tesla/595.71.05/NVIDIA-Linux-aarch64-595.71.05.run",
				"sh NVIDIA-Linux-aarch64-595.71.05.run -x",
				"curl -fsSL --retry 3 -o DRIVERS/cuda-keyring.deb https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/sbsa/cuda-keyring_1.1-1_all.deb",
			},
			wantErr: []string{"warning: no DRIVER_RUN_SHA256_ARM64 given"}},
		{name: "no version", arch: "amd64", wantErr: []string{"set --build-arg DRIVER_VERSION"}},
		{name: "no supported-gpus.json", version: "580.159.04", arch: "amd64", noGPUList: true, wantErr: []string{"the .run has no supported-gpus/supported-gpus.json"}},
		{name: "riscv64", version: "580.159.04", arch: "riscv64", wantErr: []string{"unsupported TARGETARCH riscv64"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			drivers := filepath.Join(dir, "drivers")
			moved := strings.ReplaceAll(s, "/drivers", drivers)
			log := filepath.Join(dir, "log")
			bin := fakeTools(t, log, tools)
			out, err := runScript(t, moved, bin, map[string]string{
				"DRIVER_VERSION": tt.version, "TARGETARCH": tt.arch, "DRIVER_BASE_URL": env["DRIVER_BASE_URL"],
				"CUDA_REPO_BASE": env["CUDA_REPO_BASE"], "DRIVER_RUN_SHA256_AMD64": tt.sumAMD64, "DRIVER_RUN_SHA256_ARM64": "",
				"FAKE_RUN_NO_GPU_LIST": map[bool]string{true: "1"}[tt.noGPUList],
			})
			for _, w := range tt.wantErr {
				if !strings.Contains(out, w) {
					t.Errorf("output %q lacks %q", out, w)
				}
			}
			if tt.wantCalls == nil {
				if err == nil {
					t.Fatal("succeeded")
				}
				return
			}
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			b, _ := os.ReadFile(log)
			var calls []string
			for l := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
				if f := strings.Fields(l); len(f) > 0 && (f[0] == "curl" || f[0] == "sha256sum" || f[0] == "sh") {
					calls = append(calls, strings.ReplaceAll(l, drivers, "DRIVERS"))
				}
			}
			if !slices.Equal(calls, tt.wantCalls) {
				t.Errorf("calls\n%s\nwant\n%s", strings.Join(calls, "\n"), strings.Join(tt.wantCalls, "\n"))
			}
			entries, _ := os.ReadDir(drivers)
			var names []string
			for _, e := range entries {
				names = append(names, e.Name())
			}
			if want := []string{"NVIDIA-Linux", "cuda-keyring.deb"}; !slices.Equal(names, want) {
				t.Errorf("/drivers holds %q, want %q (the .run removed, the tree where the final stage copies from)", names, want)
			}
		})
	}
}

// The build context (.dockerignore) holds exactly what the agent stage builds from: go.mod,
// go.sum, the Makefile and cmd/ and pkg/ without tests and test data (files the agent embeds
// are included).
func TestDockerignore(t *testing.T) {
	f, err := os.Open(filepath.Join(repo, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("git", "-C", repo, "ls-files").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v (apt-get install -y git)", err)
	}
	var in int
	for _, file := range strings.Fields(string(out)) {
		excluded, err := pm.MatchesOrParentMatches(file)
		if err != nil {
			t.Fatal(err)
		}
		top := strings.SplitN(file, "/", 2)[0]
		want := file == "go.mod" || file == "go.sum" || file == "Makefile" ||
			((top == "cmd" || top == "pkg") && !strings.HasSuffix(file, "_test.go") && !strings.Contains(file, "/testdata/"))
		if want == excluded {
			t.Errorf("%s: in the build context %v, want %v", file, !excluded, want)
		}
		if !excluded {
			in++
		}
	}
	if in < 10 {
		t.Errorf("only %d files in the build context", in)
	}
}
