package build

import (
	"bufio"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/driver-agent/driver-agent/pkg/host"
)

// memoryPerJob is the memory one compile job is given when choosing the
// default number of jobs: NVIDIA's larger sources take about that much with
// gcc at -O2.
const memoryPerJob = 3 << 29 // 1.5 GiB

// maxJobs bounds the number of jobs, as MAX_THREADS is bounded.
const maxJobs = 1024

// DefaultJobs returns the number of parallel build jobs used when none is
// given (MAX_THREADS unset): the CPUs this process may use (host.CPUs, which
// follows the container's CPU limit), but no more than one job per 1.5 GiB of
// memory, and at least one. The memory is MemTotal in r.Proc/meminfo or the
// container's memory limit in r.Sys/fs/cgroup (cgroup v2 memory.max, v1
// memory.limit_in_bytes), whichever is lower: a pod limited to 4 GiB on a
// 64-core node must not start 64 compilers. When neither can be read the CPUs
// alone decide.
func DefaultJobs(r host.Roots) int {
	var mem uint64
	if f, err := os.Open(r.InProc("meminfo")); err == nil {
		mem, _ = ParseMemTotal(io.LimitReader(f, 64<<10))
		f.Close()
	}
	for _, limit := range []string{"fs/cgroup/memory.max", "fs/cgroup/memory/memory.limit_in_bytes"} {
		b, err := os.ReadFile(r.InSys(limit))
		if err != nil {
			continue
		}
		if n, ok := ParseMemoryLimit(string(b)); ok && (mem == 0 || n < mem) {
			mem = n
		}
		break
	}
	return JobsFor(host.CPUs(), mem)
}

// ParseMemoryLimit reads a cgroup memory limit file: a number of bytes, or
// "max" (v2's "no limit"; v1 writes a huge number instead, which MemTotal then
// undercuts). ok is false for "max", zero and anything malformed.
func ParseMemoryLimit(s string) (bytes uint64, ok bool) {
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
	if err != nil || n == 0 {
		return 0, false
	}
	return n, true
}

// JobsFor returns min(cpus, memBytes/1.5 GiB), at least 1 and at most 1024;
// memBytes 0 means unknown (the CPUs decide).
func JobsFor(cpus int, memBytes uint64) int {
	n := cpus
	if memBytes > 0 {
		byMem := memBytes / memoryPerJob
		if byMem < uint64(n) {
			n = int(byMem)
		}
	}
	return max(1, min(n, maxJobs))
}

// ParseMemTotal returns the MemTotal line of /proc/meminfo in bytes ("MemTotal:
// 16316412 kB"); ok is false when there is no well-formed line.
func ParseMemTotal(r io.Reader) (bytes uint64, ok bool) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		rest, found := strings.CutPrefix(sc.Text(), "MemTotal:")
		if !found {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 || len(f) > 2 {
			return 0, false
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		unit := uint64(1)
		if len(f) == 2 {
			switch f[1] {
			case "kB":
				unit = 1024
			case "B":
			default:
				return 0, false
			}
		}
		if n > ^uint64(0)/unit {
			return 0, false
		}
		return n * unit, true
	}
	return 0, false
}
