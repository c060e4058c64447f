package config

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
)

func TestDefaultsAndPrecedence(t *testing.T) {
	t.Parallel()
	c, rest, err := Parse("t", []string{"--log-level", "debug", "--dry-run", "extra"}, []string{"DRIVER_AGENT_LOG_LEVEL=warn", "DRIVER_AGENT_RUN=/host/run", "DRIVER_VERSION=580.95.05", "GPU_DIRECT_RDMA_ENABLED=true", "MAX_THREADS=8", "NVFM_CONFIG_FABRIC_MODE=1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.LogLevel != "debug" || c.Run != "/host/run" || c.Proc != "/proc" || c.HostRoot != "/proc/1/root" || !c.DryRun {
		t.Errorf("flag > env > default broken: %+v", c)
	}
	if c.DriverVersion != "580.95.05" || !c.RDMA || c.MaxThreads != 8 || c.NVFM["FABRIC_MODE"] != "1" || c.ShutdownTimeout != 25*time.Second ||
		c.DriverType != "passthrough" || c.VGPULicenseType != "NLS" {
		t.Errorf("operator settings: %+v", c)
	}
	if len(rest) != 1 || rest[0] != "extra" {
		t.Errorf("rest = %v", rest)
	}
	if err := c.ValidateInit(); err != nil || c.DriverBranch != 580 {
		t.Errorf("ValidateInit = %v, branch %d", err, c.DriverBranch)
	}
}

// TestEveryValidationError checks that each bad value gets one line naming the variable, the
// value and what is allowed, and that all problems are reported at once.
func TestEveryValidationError(t *testing.T) {
	t.Parallel()
	cases := []struct{ env, want string }{
		{"DRIVER_AGENT_ROOT=relative", `DRIVER_AGENT_ROOT="relative": want an absolute path`},
		{"DRIVER_AGENT_HOST_ROOT=x", `DRIVER_AGENT_HOST_ROOT="x": want an absolute path`},
		{"DRIVER_AGENT_HOST_ROOT_FALLBACK=x", `DRIVER_AGENT_HOST_ROOT_FALLBACK="x": want an absolute path`},
		{"DRIVER_AGENT_PROC=proc", `DRIVER_AGENT_PROC="proc": want an absolute path`},
		{"DRIVER_AGENT_SYS=sys", `DRIVER_AGENT_SYS="sys": want an absolute path`},
		{"DRIVER_AGENT_DEV=dev", `DRIVER_AGENT_DEV="dev": want an absolute path`},
		{"DRIVER_AGENT_RUN=run", `DRIVER_AGENT_RUN="run": want an absolute path`},
		{"DRIVER_AGENT_DRIVERS_DIR=d", `DRIVER_AGENT_DRIVERS_DIR="d": want an absolute path`},
		{"DRIVER_AGENT_DRY_RUN=maybe", `DRIVER_AGENT_DRY_RUN="maybe": want true or false`},
		{"DRIVER_AGENT_OUTPUT=yaml", `DRIVER_AGENT_OUTPUT="yaml": want one of text, json`},
		{"DRIVER_AGENT_LOG_FORMAT=xml", `DRIVER_AGENT_LOG_FORMAT="xml": want one of text, json`},
		{"DRIVER_AGENT_LOG_LEVEL=loud", `DRIVER_AGENT_LOG_LEVEL="loud": want one of debug, info, warn, error`},
		{"DRIVER_AGENT_TERMINATION_LOG=t", `DRIVER_AGENT_TERMINATION_LOG="t": want an absolute path`},
		{"DRIVER_AGENT_METRICS_ADDRESS=9402", `DRIVER_AGENT_METRICS_ADDRESS="9402": want host:port or :port, such as :9402`},
		{"DRIVER_AGENT_SHUTDOWN_TIMEOUT=forever", `DRIVER_AGENT_SHUTDOWN_TIMEOUT="forever": want a duration from 1s to 10m0s`},
		{"DRIVER_AGENT_DAEMON_STOP_TIMEOUT=1ms", `DRIVER_AGENT_DAEMON_STOP_TIMEOUT="1ms": want a duration from 100ms to 5m0s`},
		{"DRIVER_AGENT_UNLOAD_TIMEOUT=0s", `DRIVER_AGENT_UNLOAD_TIMEOUT="0s": want a duration from 1s to 1h0m0s`},
		{"DRIVER_AGENT_UNLOAD_FOREIGN_HOLDERS=all", `DRIVER_AGENT_UNLOAD_FOREIGN_HOLDERS="all": want true or false`},
		{"DRIVER_AGENT_HOST_MODULES_TIMEOUT=soon", `DRIVER_AGENT_HOST_MODULES_TIMEOUT="soon": want a duration from 0s to 24h0m0s`},
		{"DRIVER_AGENT_NVLINK5_PREREQ_TIMEOUT=0s", `DRIVER_AGENT_NVLINK5_PREREQ_TIMEOUT="0s": want a duration from 1s to 24h0m0s`},
		{"DRIVER_AGENT_MODULES=kernel", `DRIVER_AGENT_MODULES="kernel": want one of auto, load, host`},
		{"DRIVER_AGENT_LOAD_DRM=yes", `DRIVER_AGENT_LOAD_DRM="yes": want true or false`},
		{"DRIVER_AGENT_PERSISTENCED_ARGS=a\x01b", `DRIVER_AGENT_PERSISTENCED_ARGS="a\x01b": want arguments without control characters`},
		{"DRIVER_AGENT_CACHE_DIR=cache", `DRIVER_AGENT_CACHE_DIR="cache": want an absolute path`},
		{"DRIVER_AGENT_CACHE_MAX_ENTRIES=-1", `DRIVER_AGENT_CACHE_MAX_ENTRIES="-1": want a whole number from 0 to 1000`},
		{"DRIVER_AGENT_REQUIRE_SIGNED=maybe", `DRIVER_AGENT_REQUIRE_SIGNED="maybe": want true or false`},
		{"DRIVER_AGENT_WORK_DIR=tmp", `DRIVER_AGENT_WORK_DIR="tmp": want an absolute path`},
		{"DRIVER_AGENT_KERNEL_BUILD_TREE=build", `DRIVER_AGENT_KERNEL_BUILD_TREE="build": want an absolute path`},
		{"DRIVER_AGENT_FLATCAR_RELEASE_URL=https://m.example/{version} ftp://m.example/", `DRIVER_AGENT_FLATCAR_RELEASE_URL="https://m.example/{version} ftp://m.example/": want http://, https:// or file:/// URLs, or absolute paths`},
		{"DRIVER_AGENT_FLATCAR_SIGNING_KEY=key.asc", `DRIVER_AGENT_FLATCAR_SIGNING_KEY="key.asc": want an absolute path`},
		{"DRIVER_AGENT_INSECURE_SKIP_VERIFY=yes", `DRIVER_AGENT_INSECURE_SKIP_VERIFY="yes": want true or false`},
		{"DRIVER_AGENT_CC=gcc -m64", `DRIVER_AGENT_CC="gcc -m64": want a compiler name or path without spaces`},
		{"DRIVER_AGENT_MODULE_PARAM=nvidia", `DRIVER_AGENT_MODULE_PARAM="nvidia": `},
		{"DRIVER_VERSION=latest", `DRIVER_VERSION="latest": want a driver version such as 580.95.05`},
		{"DRIVER_BRANCH=r580", `DRIVER_BRANCH="r580": want a branch number such as 580`},
		{"KERNEL_MODULE_TYPE=closed", `KERNEL_MODULE_TYPE="closed": want one of auto, open, proprietary`},
		{"DRIVER_CONFIG_DIGEST=a b", `DRIVER_CONFIG_DIGEST="a b": want at most 256 characters without spaces or control characters`},
		{"GPU_DIRECT_RDMA_ENABLED=on", `GPU_DIRECT_RDMA_ENABLED="on": want true or false`},
		{"USE_HOST_MOFED=1x", `USE_HOST_MOFED="1x": want true or false`},
		{"MAX_THREADS=0", `MAX_THREADS="0": want a whole number from 1 to 1024`},
		{"DRIVER_TYPE=vgpu-host", `DRIVER_TYPE="vgpu-host": want one of passthrough, vgpu`},
		{"VGPU_LICENSE_SERVER_TYPE=NLS server", `VGPU_LICENSE_SERVER_TYPE="NLS server": want a single word such as NLS`},
		{"NVFM_CONFIG_fabric_mode=1", `NVFM_CONFIG_fabric_mode: the fabric manager key "fabric_mode" must match [A-Z0-9_]+`},
		{"NVFM_CONFIG_LOG_FILE_NAME=a\nb", `NVFM_CONFIG_LOG_FILE_NAME="a\nb": want a single-line value`},
	}
	covered := map[string]bool{}
	var all []string
	for _, c := range cases {
		all = append(all, c.env)
		covered[strings.SplitN(c.env, "=", 2)[0]] = true
		_, _, err := Parse("t", nil, []string{c.env}, io.Discard)
		if !errors.Is(err, exitcode.ErrConfig) {
			t.Errorf("%q: error %v is not a config error", c.env, err)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error\n%v\ndoes not contain\n%s", c.env, err, c.want)
		}
	}
	for _, o := range Options() {
		if !covered[o.Env] && o.Env != "NODE_NAME" {
			t.Errorf("no validation case for %s", o.Env)
		}
	}
	_, _, err := Parse("t", nil, all, io.Discard)
	if n := strings.Count(err.Error(), "\n"); n != len(cases) {
		t.Errorf("all bad values at once: %d lines, want %d:\n%v", n, len(cases), err)
	}
	// The command line gets the same checks and names the flag.
	_, _, err = Parse("t", []string{"--max-threads", "-3"}, nil, io.Discard)
	if !errors.Is(err, exitcode.ErrConfig) || !strings.Contains(err.Error(), `--max-threads="-3"`) {
		t.Errorf("flag value error = %v", err)
	}
}

func TestModuleParams(t *testing.T) {
	t.Parallel()
	c, _, err := Parse("t", []string{"--module-param", "nvidia.NVreg_A=1", "--module-param", "nvidia-uvm.uvm_b=2"}, []string{"DRIVER_AGENT_MODULE_PARAM=nvidia.NVreg_A=0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.ModuleParams.Params("nvidia").String(); got != "NVreg_A=1" {
		t.Errorf("nvidia params %q: the flags replace the environment variable", got)
	}
	if got := c.ModuleParams.Params("nvidia_uvm").String(); got != "uvm_b=2" {
		t.Errorf("nvidia_uvm params %q", got)
	}
	if _, _, err := Parse("t", []string{"--module-param", "nvidia.x=\x01"}, nil, io.Discard); err == nil {
		t.Error("control character accepted")
	}
}

// TestFlatcarReleaseURLs: remote mirrors, and local ones given as file:/// URLs or absolute paths.
func TestFlatcarReleaseURLs(t *testing.T) {
	t.Parallel()
	c, _, err := Parse("t", []string{"--flatcar-release-url", "https://m.example/{version}/ file:///mnt/a/{version}/", "--flatcar-release-url", "/mnt/b/{channel}/{board}/{version}/"}, nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"https://m.example/{version}/", "file:///mnt/a/{version}/", "file:///mnt/b/{channel}/{board}/{version}/"}
	if !slices.Equal(c.FlatcarReleaseURLs, want) {
		t.Errorf("URLs %q, want %q", c.FlatcarReleaseURLs, want)
	}
	for _, bad := range []string{"mirror/{version}/", "file://host/x/", "/mnt/100%/{version}/", "/mnt/a?b/"} {
		if _, _, err := Parse("t", []string{"--flatcar-release-url", bad}, nil, io.Discard); !errors.Is(err, exitcode.ErrConfig) {
			t.Errorf("%q: %v, want a config error", bad, err)
		}
	}
}

func TestValidateInit(t *testing.T) {
	t.Parallel()
	c, _, _ := Parse("t", nil, nil, io.Discard)
	if err := c.ValidateInit(); !errors.Is(err, exitcode.ErrConfig) || !strings.Contains(err.Error(), `DRIVER_VERSION="": required`) {
		t.Errorf("missing version: %v", err)
	}
	c, _, _ = Parse("t", nil, []string{"DRIVER_VERSION=535.309.01", "DRIVER_BRANCH=580"}, io.Discard)
	if err := c.ValidateInit(); err == nil || !strings.Contains(err.Error(), `DRIVER_BRANCH="580": does not match DRIVER_VERSION="535.309.01"`) {
		t.Errorf("branch mismatch: %v", err)
	}
}

// TestValidateInitParamFiles: the operator's parameter files are checked with the rest of the
// configuration, every problem of every file reported at once; missing files are fine.
func TestValidateInitParamFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	env := []string{"DRIVER_VERSION=535.309.01", "DRIVER_AGENT_DRIVERS_DIR=" + dir}
	write := func(name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("nvidia.conf", "# comment\nNVreg_EnableGpuFirmware=0 NVreg_RegistryDwords=\"a=1;b=2\"\n")
	write("other.conf", "not=\"read")
	c, _, err := Parse("t", nil, env, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ValidateInit(); err != nil {
		t.Fatalf("valid nvidia.conf: %v", err)
	}
	write("nvidia.conf", "NVreg_EnableGpuFirmware=0\nNVreg_X=\"unterminated\n")
	write("nvidia-peermem.conf", "peerdirect_support=\x01\n")
	if err := os.Mkdir(filepath.Join(dir, "nvidia-uvm.conf"), 0o755); err != nil {
		t.Fatal(err)
	}
	err = c.ValidateInit()
	if !errors.Is(err, exitcode.ErrConfig) {
		t.Fatalf("ValidateInit = %v, want a config error", err)
	}
	for _, want := range []string{
		filepath.Join(dir, "nvidia.conf") + `:2: parameter "NVreg_X=\"unterminated": misplaced double quote: unterminated quoted value`,
		filepath.Join(dir, "nvidia-peermem.conf") + ":1:",
		filepath.Join(dir, "nvidia-uvm.conf") + ": not a regular file",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error\n%v\ndoes not contain\n%s", err, want)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	t.Parallel()
	_, _, err := Parse("t", []string{"--no-such-flag"}, nil, io.Discard)
	if !errors.Is(err, exitcode.ErrUsage) {
		t.Errorf("unknown flag: %v", err)
	}
	var help strings.Builder
	_, _, err = Parse("t", []string{"--help"}, nil, &help)
	if !errors.Is(err, flag.ErrHelp) || !strings.Contains(help.String(), "[DRIVER_VERSION]") {
		t.Errorf("help: %v\n%s", err, help.String())
	}
}

// NVIDIA's script's options parse in getopt's forms: -m is --max-threads, -a is accepted, -k, -s
// and -t are kept for their warnings; none is a usage error.
func TestScriptFlags(t *testing.T) {
	want := ScriptFlags{AcceptLicense: true, Kernel: "6.1.0-57-amd64", Sign: "key1", Tag: "builtin"}
	for _, args := range [][]string{
		{"-a", "-m", "4", "-k", "6.1.0-57-amd64", "-s", "key1", "-t", "builtin"},
		{"--accept-license", "--max-threads=4", "--kernel", "6.1.0-57-amd64", "--sign=key1", "--tag", "builtin"},
		{"-am4", "-k6.1.0-57-amd64", "-skey1", "-tbuiltin"},
		{"-am", "4", "--dry-run", "-k", "6.1.0-57-amd64", "-s", "key1", "-t=builtin"},
	} {
		c, rest, err := Parse("t", args, nil, io.Discard)
		if err != nil {
			t.Errorf("%q: %v", args, err)
			continue
		}
		if c.MaxThreads != 4 || c.Script != want || len(rest) != 0 {
			t.Errorf("%q: max threads %d, script %+v, rest %q", args, c.MaxThreads, c.Script, rest)
		}
	}
	c, _, err := Parse("t", []string{"-m", "lots"}, nil, io.Discard)
	if !errors.Is(err, exitcode.ErrConfig) || c != nil {
		t.Errorf("-m lots: %v, want a config error", err)
	}
	if _, _, err := Parse("t", []string{"-ax"}, nil, io.Discard); !errors.Is(err, exitcode.ErrUsage) {
		t.Errorf("-ax: %v, want a usage error", err)
	}
	// A value is never taken apart, and the agent's own one-dash flags stay whole.
	c, _, err = Parse("t", []string{"--persistenced-args", "-am4", "-sys", "/s", "-kernel", "6.1"}, nil, io.Discard)
	if err != nil || strings.Join(c.PersistencedArgs, " ") != "-am4" || c.Sys != "/s" || c.Script.Kernel != "6.1" || c.Script.AcceptLicense {
		t.Errorf("%+v, %v", c, err)
	}
	notes := strings.Join(want.Notes("6.1.0-57-amd64"), "\n")
	for _, w := range []string{"-s/--sign key1 ignored", "--require-signed", "-t/--tag builtin ignored"} {
		if !strings.Contains(notes, w) {
			t.Errorf("notes lack %q:\n%s", w, notes)
		}
	}
	if strings.Contains(notes, "--kernel") {
		t.Errorf("-k naming the running kernel is warned about:\n%s", notes)
	}
	if n := want.Notes("6.6.95-flatcar"); !strings.Contains(n[0], "-k/--kernel 6.1.0-57-amd64 ignored: the agent installs for the running kernel (6.6.95-flatcar)") {
		t.Errorf("notes %q", n)
	}
}

func FuzzExpandScriptShort(f *testing.F) {
	f.Add("-am4 -k 6.1 --tag builtin")
	f.Add("--root / -m -a -s")
	f.Add("-x -- -am4")
	fs := flag.NewFlagSet("fuzz", flag.ContinueOnError)
	for _, n := range []string{"root", "m", "k", "s", "t", "sys"} {
		fs.String(n, "", "")
	}
	fs.Bool("a", false, "")
	isFlag := func(n string) bool { return fs.Lookup(n) != nil }
	isBool := func(n string) bool { return n == "a" }
	f.Fuzz(func(t *testing.T, line string) {
		args := strings.Fields(line)
		once := expandScriptShort(args, isFlag, isBool)
		if len(once) < len(args) {
			t.Fatalf("%q -> %q lost arguments", args, once)
		}
		if twice := expandScriptShort(once, isFlag, isBool); !slices.Equal(once, twice) {
			t.Fatalf("not idempotent: %q -> %q -> %q", args, once, twice)
		}
		if strings.ReplaceAll(strings.Join(once, ""), "-", "") != strings.ReplaceAll(strings.Join(args, ""), "-", "") {
			t.Fatalf("%q -> %q changed the text", args, once)
		}
	})
}

// fuzzMatchesRegexp checks that match accepts exactly what the regexp pattern accepts, from seeds
// and a few edge cases common to every pattern.
func fuzzMatchesRegexp(f *testing.F, pattern string, match func(string) bool, seeds ...string) {
	re := regexp.MustCompile(pattern)
	for _, s := range append(seeds, "", " ", "\n", "\xff", "é", "\x00") {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := match(s), re.MatchString(s); got != want {
			t.Fatalf("%q: matcher says %v, %s says %v", s, got, pattern, want)
		}
	})
}

func FuzzVersionMatchesRegexp(f *testing.F) {
	fuzzMatchesRegexp(f, `^[0-9]+\.[0-9]+(\.[0-9]+)?$`, isVersion,
		"1", "1.2", "1.2.3", "1.2.3.4", "580.95.05", "1.2\n", "1.2.3\n", " 1.2", "1..2", ".1.2", "1.2.", "1.2.3.", "١.٢", "1.2\xff", "1.2-3")
}

func FuzzNVFMKeyMatchesRegexp(f *testing.F) {
	fuzzMatchesRegexp(f, `^[A-Z0-9_]+$`, isNVFMKey, "A", "FABRIC_MODE", "_9", "abc", "A-B", "A\n", "Ä", "A\xff", "A B")
}

func FuzzWordMatchesRegexp(f *testing.F) {
	fuzzMatchesRegexp(f, `^[A-Za-z0-9_-]{1,32}$`, isWord, "NLS", "a", "_-", strings.Repeat("a", 31), strings.Repeat("a", 32),
		strings.Repeat("a", 33), strings.Repeat("é", 16), "a b", "NLS\n", "a.b", "\tNLS")
}
