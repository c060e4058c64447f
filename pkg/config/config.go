// Package config turns flags and environment variables into one validated Config. Every flag has
// an environment variable: DRIVER_AGENT_<FLAG> for the agent's own settings, and the gpu-operator's
// names (DRIVER_VERSION, KERNEL_MODULE_TYPE, ...) for the settings the operator already passes.
// A command-line flag wins over its environment variable, which wins over the default.
package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/driver-agent/driver-agent/pkg/exitcode"
	"github.com/driver-agent/driver-agent/pkg/host"
	"github.com/driver-agent/driver-agent/pkg/modparams"
)

// Config is the agent's whole configuration.
type Config struct {
	host.Roots
	HostRootFallback string // used when HostRoot is unreadable

	DryRun         bool
	Output         string // text or json (dry-run plan, status)
	LogFormat      string // text or json
	LogLevel       string // debug, info, warn, error
	TerminationLog string
	MetricsAddress string

	ShutdownTimeout      time.Duration
	DaemonStopTimeout    time.Duration
	HostModulesTimeout   time.Duration
	NVLink5PrereqTimeout time.Duration
	Modules              string        // auto, load, host
	UnloadTimeout        time.Duration // bound on the unload of another configuration's driver at start
	UnloadForeignHolders bool          // also unload holders of the driver the agent did not load
	LoadDRM              bool
	PersistencedArgs     []string
	ModuleParams         modparams.Set // --module-param module.key=value, over /drivers/<module>.conf
	CacheDir             string        // "" means <run>/nvidia/driver-agent/cache
	CacheMaxEntries      int
	RequireSigned        bool
	WorkDir              string   // "" means the system temporary directory
	KernelBuildTree      string   // a kernel build tree to compile against, tried after the host's
	FlatcarReleaseURLs   []string // release server URL templates; nil means Flatcar's servers
	FlatcarSigningKey    string   // armored OpenPGP keyring replacing the embedded Flatcar key
	InsecureSkipVerify   bool     // use downloads without checking their signed digests
	CC                   string   // compiler for the module build; "" means the image's cc

	DriverVersion    string
	DriverBranch     int
	KernelModuleType string // auto, open, proprietary
	ConfigDigest     string
	RDMA             bool
	HostMOFED        bool
	MaxThreads       int // 0: chosen from the machine
	NodeName         string
	NVFM             map[string]string // NVFM_CONFIG_<KEY>=value overrides for fabricmanager.cfg
	DriverType       string            // passthrough or vgpu (a vGPU guest: nvidia-gridd, nvidia-topologyd)
	VGPULicenseType  string            // NLS copies <drivers-dir>/ClientConfigToken/* for nvidia-gridd

	Script ScriptFlags // NVIDIA's script's options without a setting here (-a, -k, -s, -t)
}

// Option describes one flag and its environment variable.
type Option struct {
	Flag    string
	Env     string
	Default string
	Usage   string
	Bool    bool
	Repeat  bool // may be given several times; the environment variable holds a space-separated list
	set     func(c *Config, v string) error
}

// Byte classes of the option values' patterns.
const (
	digits = "0123456789"
	upper  = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
	lower  = "abcdefghijklmnopqrstuvwxyz"
)

// isVersion reports whether s matches ^[0-9]+\.[0-9]+(\.[0-9]+)?$.
func isVersion(s string) bool {
	parts := strings.Split(s, ".")
	return (len(parts) == 2 || len(parts) == 3) && !slices.ContainsFunc(parts, func(p string) bool { return !isOf(p, digits) })
}

// isNVFMKey reports whether s matches ^[A-Z0-9_]+$.
func isNVFMKey(s string) bool { return isOf(s, upper+digits+"_") }

// isWord reports whether s matches ^[A-Za-z0-9_-]{1,32}$.
func isWord(s string) bool { return len(s) <= 32 && isOf(s, upper+lower+digits+"_-") }

// isOf reports whether s is not empty and has only bytes of set, which is ASCII.
func isOf(s, set string) bool { return s != "" && strings.Trim(s, set) == "" }

func agentEnv(flag string) string {
	return "DRIVER_AGENT_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// Options lists every option, in the order the help text and the README show them.
func Options() []Option {
	str := func(dst func(*Config) *string) func(*Config, string) error {
		return func(c *Config, v string) error { *dst(c) = v; return nil }
	}
	path := func(dst func(*Config) *string) func(*Config, string) error {
		return func(c *Config, v string) error {
			if !strings.HasPrefix(v, "/") {
				return errors.New("want an absolute path")
			}
			*dst(c) = v
			return nil
		}
	}
	optionalPath := func(dst func(*Config) *string) func(*Config, string) error {
		return func(c *Config, v string) error {
			if v == "" {
				*dst(c) = ""
				return nil
			}
			return path(dst)(c, v)
		}
	}
	oneOf := func(dst func(*Config) *string, allowed ...string) func(*Config, string) error {
		return func(c *Config, v string) error {
			for _, a := range allowed {
				if v == a {
					*dst(c) = v
					return nil
				}
			}
			return fmt.Errorf("want one of %s", strings.Join(allowed, ", "))
		}
	}
	boolean := func(dst func(*Config) *bool) func(*Config, string) error {
		return func(c *Config, v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return errors.New("want true or false")
			}
			*dst(c) = b
			return nil
		}
	}
	duration := func(dst func(*Config) *time.Duration, min, max time.Duration) func(*Config, string) error {
		return func(c *Config, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < min || d > max {
				return fmt.Errorf("want a duration from %s to %s, such as 25s", min, max)
			}
			*dst(c) = d
			return nil
		}
	}
	ag := func(o Option) Option { o.Env = agentEnv(o.Flag); return o }
	return []Option{
		ag(Option{Flag: "root", Default: "/", Usage: "the container's root filesystem", set: path(func(c *Config) *string { return &c.Root })}),
		ag(Option{Flag: "host-root", Default: "/proc/1/root", Usage: "the host's root filesystem (falls back to --host-root-fallback with a warning when unreadable)", set: path(func(c *Config) *string { return &c.HostRoot })}),
		ag(Option{Flag: "host-root-fallback", Default: "/", Usage: "host root to use when --host-root is unreadable", set: path(func(c *Config) *string { return &c.HostRootFallback })}),
		ag(Option{Flag: "proc", Default: "/proc", Usage: "procfs mount", set: path(func(c *Config) *string { return &c.Proc })}),
		ag(Option{Flag: "sys", Default: "/sys", Usage: "sysfs mount", set: path(func(c *Config) *string { return &c.Sys })}),
		ag(Option{Flag: "dev", Default: "/dev", Usage: "device directory", set: path(func(c *Config) *string { return &c.Dev })}),
		ag(Option{Flag: "run", Default: "/run", Usage: "run directory shared with the host (holds nvidia/)", set: path(func(c *Config) *string { return &c.Run })}),
		ag(Option{Flag: "drivers-dir", Default: "/drivers", Usage: "directory of <module>.conf parameter files (those of nvidia, nvidia-uvm, nvidia-modeset, nvidia-peermem and nvidia-drm are checked before anything is changed)", set: path(func(c *Config) *string { return &c.DriversDir })}),
		ag(Option{Flag: "dry-run", Default: "false", Bool: true, Usage: "decide and print the plan; change nothing", set: boolean(func(c *Config) *bool { return &c.DryRun })}),
		ag(Option{Flag: "output", Default: "text", Usage: "plan and status format: text or json", set: oneOf(func(c *Config) *string { return &c.Output }, "text", "json")}),
		ag(Option{Flag: "log-format", Default: "text", Usage: "log format: text or json", set: oneOf(func(c *Config) *string { return &c.LogFormat }, "text", "json")}),
		ag(Option{Flag: "log-level", Default: "info", Usage: "log level: debug, info, warn or error", set: oneOf(func(c *Config) *string { return &c.LogLevel }, "debug", "info", "warn", "error")}),
		ag(Option{Flag: "termination-log", Default: "/dev/termination-log", Usage: "file that receives a one-line exit cause when it exists and is writable", set: path(func(c *Config) *string { return &c.TerminationLog })}),
		ag(Option{Flag: "metrics-address", Default: ":9402", Usage: "listen address for /metrics, /healthz and /readyz; empty or off disables", set: func(c *Config, v string) error {
			if v == "" || v == "off" {
				c.MetricsAddress = ""
				return nil
			}
			if _, port, err := net.SplitHostPort(v); err != nil || port == "" {
				return errors.New("want host:port or :port, such as :9402")
			}
			c.MetricsAddress = v
			return nil
		}}),
		ag(Option{Flag: "shutdown-timeout", Default: "25s", Usage: "deadline for the whole teardown after a signal (keep it under the pod's grace period)", set: duration(func(c *Config) *time.Duration { return &c.ShutdownTimeout }, time.Second, 10*time.Minute)}),
		ag(Option{Flag: "daemon-stop-timeout", Default: "5s", Usage: "time a daemon gets after SIGTERM before SIGKILL", set: duration(func(c *Config) *time.Duration { return &c.DaemonStopTimeout }, 100*time.Millisecond, 5*time.Minute)}),
		ag(Option{Flag: "modules", Default: "auto", Usage: "who owns the kernel modules: auto, load (this agent) or host (never load or unload)", set: oneOf(func(c *Config) *string { return &c.Modules }, "auto", "load", "host")}),
		ag(Option{Flag: "unload-timeout", Default: "60s", Usage: "at start, how long to wait for a loaded NVIDIA driver of another configuration to become unused before exit 10 (the teardown's wait is bounded by --shutdown-timeout)", set: duration(func(c *Config) *time.Duration { return &c.UnloadTimeout }, time.Second, time.Hour)}),
		ag(Option{Flag: "unload-foreign-holders", Default: "false", Bool: true, Usage: "also unload modules that hold the NVIDIA driver but were not loaded by the agent (gdrdrv, nvidia_fs, a sidecar's nvidia_peermem); without it they count as users of the driver", set: boolean(func(c *Config) *bool { return &c.UnloadForeignHolders })}),
		ag(Option{Flag: "host-modules-timeout", Default: "5m", Usage: "with --modules=host, how long to wait for the host to load nvidia", set: duration(func(c *Config) *time.Duration { return &c.HostModulesTimeout }, 0, 24*time.Hour)}),
		ag(Option{Flag: "nvlink5-prereq-timeout", Default: "5m", Usage: "on NVLink5 nodes, how long to wait for mlx5_core and ib_umad", set: duration(func(c *Config) *time.Duration { return &c.NVLink5PrereqTimeout }, time.Second, 24*time.Hour)}),
		ag(Option{Flag: "load-drm", Default: "false", Bool: true, Usage: "also load nvidia-drm", set: boolean(func(c *Config) *bool { return &c.LoadDRM })}),
		ag(Option{Flag: "persistenced-args", Default: "--persistence-mode", Usage: "arguments for nvidia-persistenced", set: func(c *Config, v string) error {
			if strings.ContainsFunc(v, unicode.IsControl) {
				return errors.New("want arguments without control characters")
			}
			c.PersistencedArgs = strings.Fields(v)
			return nil
		}}),
		ag(Option{Flag: "cache-dir", Usage: "host cache of ready modules (default <run>/nvidia/driver-agent/cache; point it at a hostPath to survive reboots)", set: optionalPath(func(c *Config) *string { return &c.CacheDir })}),
		ag(Option{Flag: "cache-max-entries", Default: "4", Usage: "cache entries kept, oldest removed first (0 disables the cache)", set: func(c *Config, v string) error {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > 1000 {
				return errors.New("want a whole number from 0 to 1000")
			}
			c.CacheMaxEntries = n
			return nil
		}}),
		ag(Option{Flag: "require-signed", Default: "false", Bool: true, Usage: "refuse modules whose stored signature cannot be re-attached", set: boolean(func(c *Config) *bool { return &c.RequireSigned })}),
		ag(Option{Flag: "work-dir", Usage: "where the compile path extracts the kernel build tree and builds (default: the system temporary directory, in the container's filesystem); needs about 2 GiB", set: optionalPath(func(c *Config) *string { return &c.WorkDir })}),
		ag(Option{Flag: "kernel-build-tree", Usage: "a kernel build tree (the directory with the kernel's Makefile and .config) to compile against when the host has none (tried after the host's /usr/lib/modules/<kver>/build)", set: optionalPath(func(c *Config) *string { return &c.KernelBuildTree })}),
		ag(Option{Flag: "flatcar-release-url", Repeat: true, Usage: "release server URL template (http or https, or a local mirror as file:///dir or /dir; a server's redirect may only go to http or https), repeatable, tried in order; {channel}, {board}, {arch} and {version} are filled in (default: Flatcar's release servers, then its bincache); for mirrors and air-gapped clusters", set: func(c *Config, v string) error {
			var urls []string
			for _, u := range strings.Fields(v) {
				switch {
				case strings.HasPrefix(u, "https://"), strings.HasPrefix(u, "http://"), strings.HasPrefix(u, "file:///"):
				case strings.HasPrefix(u, "/") && !strings.ContainsAny(u, "%?#"):
					// A mirror in a local directory. Only a URL configured here may be local:
					// a server's redirect to file:// is refused.
					u = "file://" + u
				default:
					return errors.New("want http://, https:// or file:/// URLs, or absolute paths")
				}
				urls = append(urls, u)
			}
			c.FlatcarReleaseURLs = urls
			return nil
		}}),
		ag(Option{Flag: "flatcar-signing-key", Usage: "armored OpenPGP public keyring that replaces the embedded Flatcar image signing key", set: optionalPath(func(c *Config) *string { return &c.FlatcarSigningKey })}),
		ag(Option{Flag: "insecure-skip-verify", Default: "false", Bool: true, Usage: "use downloaded kernel build trees without checking their signed digests (logged as a warning on every use)", set: boolean(func(c *Config) *bool { return &c.InsecureSkipVerify })}),
		ag(Option{Flag: "cc", Usage: "compiler for the module build, when the image's cc differs from the one that built the kernel", set: func(c *Config, v string) error {
			if strings.ContainsFunc(v, unicode.IsSpace) {
				return errors.New("want a compiler name or path without spaces")
			}
			c.CC = v
			return nil
		}}),
		ag(Option{Flag: "module-param", Repeat: true, Usage: "module.key=value, repeatable (the variable takes a space-separated list); overrides /drivers/<module>.conf", set: func(c *Config, v string) error {
			var f modparams.Flag
			for _, p := range strings.Fields(v) {
				if err := f.Set(p); err != nil {
					return err
				}
			}
			c.ModuleParams = f.Params
			return nil
		}}),
		{Flag: "driver-version", Env: "DRIVER_VERSION", Usage: "NVIDIA driver version, e.g. 580.95.05 (required for init)", set: func(c *Config, v string) error {
			if v != "" && !isVersion(v) {
				return errors.New("want a driver version such as 580.95.05")
			}
			c.DriverVersion = v
			return nil
		}},
		{Flag: "driver-branch", Env: "DRIVER_BRANCH", Usage: "driver branch, e.g. 580 (default: the major number of the driver version)", set: func(c *Config, v string) error {
			if v == "" {
				return nil
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 9999 {
				return errors.New("want a branch number such as 580")
			}
			c.DriverBranch = n
			return nil
		}},
		{Flag: "kernel-module-type", Env: "KERNEL_MODULE_TYPE", Default: "auto", Usage: "kernel module flavour: auto (decided from the GPUs), open or proprietary", set: oneOf(func(c *Config) *string { return &c.KernelModuleType }, "auto", "open", "proprietary")},
		{Flag: "driver-config-digest", Env: "DRIVER_CONFIG_DIGEST", Usage: "the operator's digest of the driver configuration; equal digests keep loaded modules", set: func(c *Config, v string) error {
			if strings.ContainsFunc(v, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) || len(v) > 256 {
				return errors.New("want at most 256 characters without spaces or control characters")
			}
			c.ConfigDigest = v
			return nil
		}},
		{Flag: "gpu-direct-rdma", Env: "GPU_DIRECT_RDMA_ENABLED", Default: "false", Bool: true, Usage: "load nvidia-peermem when a Mellanox device exists", set: boolean(func(c *Config) *bool { return &c.RDMA })},
		{Flag: "use-host-mofed", Env: "USE_HOST_MOFED", Default: "false", Bool: true, Usage: "MOFED is installed on the host rather than by the network operator", set: boolean(func(c *Config) *bool { return &c.HostMOFED })},
		{Flag: "max-threads", Env: "MAX_THREADS", Usage: "parallel build jobs, 1-1024 (default: the CPUs the container may use, at most one job per 1.5 GiB of memory or of the container's memory limit)", set: func(c *Config, v string) error {
			if v == "" {
				return nil
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 1024 {
				return errors.New("want a whole number from 1 to 1024")
			}
			c.MaxThreads = n
			return nil
		}},
		{Flag: "node-name", Env: "NODE_NAME", Usage: "the Kubernetes node name (for logs and metrics)", set: str(func(c *Config) *string { return &c.NodeName })},
		{Flag: "driver-type", Env: "DRIVER_TYPE", Default: "passthrough", Usage: "passthrough (bare metal or GPU passthrough) or vgpu (a vGPU guest: also copy the licensing files and run nvidia-gridd and nvidia-topologyd)", set: oneOf(func(c *Config) *string { return &c.DriverType }, "passthrough", "vgpu")},
		{Flag: "vgpu-license-server-type", Env: "VGPU_LICENSE_SERVER_TYPE", Default: "NLS", Usage: "with DRIVER_TYPE=vgpu: NLS also copies <drivers-dir>/ClientConfigToken/* to /etc/nvidia/ClientConfigToken/ for nvidia-gridd; any other single word (a legacy license server) copies only gridd.conf", set: func(c *Config, v string) error {
			if !isWord(v) {
				return errors.New("want a single word such as NLS")
			}
			c.VGPULicenseType = v
			return nil
		}},
	}
}

// value is a flag.Value that only remembers the raw text; conversion happens in Load so that
// flags and environment variables get the same checks and the same messages.
type value struct {
	text   string
	set    bool
	isBool bool
	repeat bool
}

func (v *value) String() string { return v.text }
func (v *value) Set(s string) error {
	if v.repeat && v.set {
		v.text += " " + s
	} else {
		v.text = s
	}
	v.set = true
	return nil
}
func (v *value) IsBoolFlag() bool { return v.isBool }

// Parse parses args (after the subcommand) and environ (os.Environ's form) into a Config. A malformed
// command line returns an error wrapping exitcode.ErrUsage; bad values wrap exitcode.ErrConfig
// with one line per problem naming the flag or variable, the value and what is allowed; neither is
// written to stderr. --help writes the usage for name to stderr and returns flag.ErrHelp.
func Parse(name string, args []string, environ []string, stderr io.Writer) (*Config, []string, error) {
	env := map[string]string{}
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	// The caller reports a malformed command line once, with the usage; the flag package's own
	// message and usage would print before it.
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	opts := Options()
	vals := make([]*value, len(opts))
	var script ScriptFlags
	for i, o := range opts {
		vals[i] = &value{isBool: o.Bool, repeat: o.Repeat}
		fs.Var(vals[i], o.Flag, o.Usage+" ["+o.Env+"]")
	}
	registerScriptFlags(fs, &script, fs.Lookup("max-threads").Value)
	fs.Usage = func() {}
	isFlag := func(n string) bool { return fs.Lookup(n) != nil }
	isBool := func(n string) bool {
		b, ok := fs.Lookup(n).Value.(interface{ IsBoolFlag() bool })
		return ok && b.IsBoolFlag()
	}
	if err := fs.Parse(expandScriptShort(args, isFlag, isBool)); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			Usage(stderr, name)
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("%w: %w", exitcode.ErrUsage, err)
	}
	c := &Config{Script: script}
	var errs []error
	for i, o := range opts {
		text, from := o.Default, "default of --"+o.Flag
		if v := env[o.Env]; v != "" {
			text, from = v, o.Env
		}
		if vals[i].set {
			text, from = vals[i].text, "--"+o.Flag
		}
		if err := o.set(c, text); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q: %w", from, text, err))
		}
	}
	nvfm, err := nvfmFromEnv(env)
	errs = append(errs, err)
	c.NVFM = nvfm
	if err := errors.Join(errs...); err != nil {
		return nil, nil, fmt.Errorf("%w:\n%w", exitcode.ErrConfig, err)
	}
	return c, fs.Args(), nil
}

// CheckNVFMOverride checks one NVFM_CONFIG_<KEY>=<value> override: the key matches ^[A-Z0-9_]+$
// and the value is a single line without NUL. It is the one check, for the environment and for
// the fabric package's overrides.
func CheckNVFMOverride(key, value string) error {
	switch {
	case !isNVFMKey(key):
		return fmt.Errorf("NVFM_CONFIG_%s: the fabric manager key %q must match [A-Z0-9_]+", key, key)
	case strings.ContainsAny(value, "\n\r\x00"):
		return fmt.Errorf("NVFM_CONFIG_%s=%q: want a single-line value without NUL", key, value)
	}
	return nil
}

// nvfmFromEnv collects NVFM_CONFIG_<KEY>=value overrides.
func nvfmFromEnv(env map[string]string) (map[string]string, error) {
	out := map[string]string{}
	names := make([]string, 0, len(env))
	for name := range env {
		names = append(names, name)
	}
	sort.Strings(names)
	var errs []error
	for _, name := range names {
		key, ok := strings.CutPrefix(name, "NVFM_CONFIG_")
		if !ok {
			continue
		}
		if err := CheckNVFMOverride(key, env[name]); err != nil {
			errs = append(errs, err)
			continue
		}
		out[key] = env[name]
	}
	return out, errors.Join(errs...)
}

// ValidateInit checks what `init` needs beyond well-formed values, before any side effect.
func (c *Config) ValidateInit() error {
	var errs []error
	if c.DriverVersion == "" {
		errs = append(errs, errors.New(`DRIVER_VERSION="": required; set it to the driver version in the image, e.g. 580.95.05`))
	} else {
		major, _ := strconv.Atoi(strings.SplitN(c.DriverVersion, ".", 2)[0])
		if c.DriverBranch == 0 {
			c.DriverBranch = major
		} else if c.DriverBranch != major {
			errs = append(errs, fmt.Errorf("DRIVER_BRANCH=%q: does not match DRIVER_VERSION=%q; want %d or unset", strconv.Itoa(c.DriverBranch), c.DriverVersion, major))
		}
	}
	// The operator's parameter files are configuration too: a bad one fails here, before the
	// agent changes anything, not in the load phase after a build and a cache store.
	if _, err := modparams.LoadDir(c.DriversDir, paramFileModules()); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w:\n%w", exitcode.ErrConfig, err)
	}
	return nil
}

// paramFileModules are the modules whose <drivers-dir>/<module>.conf the agent reads: every
// NVIDIA module it may load, whether or not this node needs it.
func paramFileModules() []string {
	return []string{"nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-peermem", "nvidia-drm"}
}

// NVFMUsage describes the NVFM_CONFIG_<KEY> variables, the one setting that is not an Option (its
// names are not fixed).
const NVFMUsage = "KEY=value for the fabric manager configuration (KEY must match [A-Z0-9_]+)"

// Usage writes the flag reference for the command name (e.g. "driver-agent init").
func Usage(w io.Writer, name string) {
	fmt.Fprintf(w, "Usage: %s [flags]\n\nFlags (each also read from the environment variable in brackets):\n", name)
	for _, o := range Options() {
		def := ""
		if o.Default != "" {
			def = " (default " + o.Default + ")"
		}
		fmt.Fprintf(w, "  --%s\t%s%s [%s]\n", o.Flag, o.Usage, def, o.Env)
	}
	fmt.Fprintf(w, "  NVFM_CONFIG_<KEY>=value\t%s\n", NVFMUsage)
	scriptUsage(w)
}
