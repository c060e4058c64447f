package kernel

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
)

const procModules = `nvidia_uvm 1540096 0 - Live 0xffffffffc1a00000 (PO)
nvidia_modeset 1241088 0 - Live 0x0000000000000000 (PO)
nvidia 56799232 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (PO)
ipmi_devintf 20480 0 - Live 0x0000000000000000
i2c_core 102400 1 nvidia, Loading 0x0000000000000000
kvm 1146880 1 [permanent], Live 0x0000000000000000
`

// ReadAttr returns an attribute whole, a page at most; more is refused as no sysfs attribute,
// and a missing file is fs.ErrNotExist.
func TestReadAttr(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	page, over := strings.Repeat("7", attrMax), strings.Repeat("7", attrMax+1)
	for name, v := range map[string]string{"vendor": "0x10de\n", "page": page, "over": over} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for name, want := range map[string]string{"vendor": "0x10de\n", "page": page} {
		if got, err := ReadAttr(filepath.Join(dir, name)); err != nil || string(got) != want {
			t.Errorf("ReadAttr(%s) = %d bytes, %v; want %d bytes", name, len(got), err, len(want))
		}
	}
	if _, err := ReadAttr(filepath.Join(dir, "over")); err == nil || !strings.Contains(err.Error(), "longer than the 4096 bytes") {
		t.Errorf("ReadAttr of %d bytes: %v", attrMax+1, err)
	}
	if _, err := ReadAttr(filepath.Join(dir, "missing")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ReadAttr of a missing file: %v, want fs.ErrNotExist", err)
	}
}

func TestParseModules(t *testing.T) {
	t.Parallel()
	mods, err := ParseModules(strings.NewReader(procModules))
	if err != nil {
		t.Fatal(err)
	}
	if len(mods) != 6 {
		t.Fatalf("got %d modules, want 6", len(mods))
	}
	nv := mods[2]
	if nv.Name != "nvidia" || nv.Size != 56799232 || nv.RefCnt != 2 || !reflect.DeepEqual(nv.UsedBy, []string{"nvidia_uvm", "nvidia_modeset"}) {
		t.Errorf("nvidia = %+v", nv)
	}
	if mods[4].State != "Loading" || mods[5].UsedBy != nil {
		t.Errorf("i2c_core = %+v, kvm = %+v", mods[4], mods[5])
	}
}

func TestParseModulesMalformed(t *testing.T) {
	t.Parallel()
	for name, in := range map[string]string{
		"few fields":  "nvidia 123 0 -\n",
		"bad size":    "nvidia 12x 0 - Live 0x0\n",
		"bad refcnt":  "nvidia 12 -3 - Live 0x0\n",
		"bad name":    "nv/idia 12 0 - Live 0x0\n",
		"bad holder":  "nvidia 12 1 a/b, Live 0x0\n",
		"second line": "ok 1 0 - Live 0x0\nbroken\n",
	} {
		if _, err := ParseModules(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error for %q", name, in)
		} else if !strings.Contains(err.Error(), "line") {
			t.Errorf("%s: error %q does not name the line", name, err)
		}
	}
}

func FuzzParseModules(f *testing.F) {
	f.Add(procModules)
	f.Add("a 1 - - Live\n")
	f.Add("x 1 1 ,,, Live 0x0 (O)\n\n")
	f.Fuzz(func(t *testing.T, in string) {
		mods, err := ParseModules(strings.NewReader(in))
		if err != nil {
			return
		}
		for _, m := range mods {
			if !ValidModuleName(m.Name) || m.RefCnt < -1 {
				t.Fatalf("accepted bad module %+v", m)
			}
			for _, u := range m.UsedBy {
				if !ValidModuleName(u) {
					t.Fatalf("accepted bad holder %q", u)
				}
			}
		}
	})
}

func writeTree(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, c := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(p, "/") {
			continue
		}
		if err := os.WriteFile(full, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestReleaseAndBanner(t *testing.T) {
	t.Parallel()
	root := writeTree(t, map[string]string{
		"sys/kernel/osrelease": "6.6.95-flatcar\n",
		"version":              "Linux version 6.6.95-flatcar (build@pony) (gcc 14) #1 SMP Tue Jul 1 2025\nsecond\n",
	})
	rel, err := Release(root)
	if err != nil || rel != "6.6.95-flatcar" {
		t.Errorf("Release = %q, %v", rel, err)
	}
	b, err := Banner(root)
	if err != nil || b != "Linux version 6.6.95-flatcar (build@pony) (gcc 14) #1 SMP Tue Jul 1 2025" {
		t.Errorf("Banner = %q, %v", b, err)
	}
	if _, err := Release(t.TempDir()); err == nil {
		t.Error("Release on empty tree: no error")
	}
}

func TestUnloadOrder(t *testing.T) {
	t.Parallel()
	sys := writeTree(t, map[string]string{
		"module/nvidia/refcnt":                     "4",
		"module/nvidia/version":                    "535.1",
		"module/nvidia/holders/nvidia_modeset":     "",
		"module/nvidia/holders/nvidia_uvm":         "",
		"module/nvidia/holders/gdrdrv":             "",
		"module/nvidia_modeset/refcnt":             "1",
		"module/nvidia_modeset/holders/nvidia_drm": "",
		"module/nvidia_drm/refcnt":                 "0",
		"module/nvidia_drm/holders/":               "",
		"module/nvidia_uvm/refcnt":                 "0",
		"module/gdrdrv/refcnt":                     "0",
		"module/i2c_core/refcnt":                   "0",
		"module/firmware_class/parameters/path":    "",
	})
	order, err := UnloadOrder(sys, []string{"nvidia", "nvidia-uvm", "nvidia_peermem", "firmware_class"})
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, n := range order {
		pos[n] = i
	}
	if len(order) != 5 {
		t.Fatalf("order = %v, want 5 modules (built-in firmware_class and absent peermem left out)", order)
	}
	for _, before := range [][2]string{{"nvidia_drm", "nvidia_modeset"}, {"nvidia_modeset", "nvidia"}, {"gdrdrv", "nvidia"}, {"nvidia_uvm", "nvidia"}} {
		if pos[before[0]] > pos[before[1]] {
			t.Errorf("order %v: %s must come before %s", order, before[0], before[1])
		}
	}
	m, err := ReadSysModule(sys, "nvidia")
	if err != nil || m.Version != "535.1" || m.RefCnt != 4 || len(m.Holders) != 3 || !m.Loaded || !m.Unloadable {
		t.Errorf("ReadSysModule = %+v, %v", m, err)
	}
}

// TestModulesWithoutUnload: a kernel built without CONFIG_MODULE_UNLOAD (seen on a node with an
// H200 and driver 580.159.04: /proc/modules shows "-" for the count) has no refcnt and no
// holder links; initstate still says the module is loaded, and that it cannot be unloaded.
func TestModulesWithoutUnload(t *testing.T) {
	t.Parallel()
	sys := writeTree(t, map[string]string{
		"module/nvidia/initstate":     "live\n",
		"module/nvidia/version":       "580.159.04\n",
		"module/nvidia/holders/":      "",
		"module/nvidia_uvm/initstate": "live\n",
		"module/nvidia_uvm/version":   "580.159.04\n",
		"module/video/parameters/":    "", // built in
	})
	m, err := ReadSysModule(sys, "nvidia")
	if err != nil || !m.Loaded || m.Unloadable || m.RefCnt != -1 || m.Version != "580.159.04" {
		t.Errorf("ReadSysModule = %+v, %v; want loaded, not unloadable, no count", m, err)
	}
	order, err := UnloadOrder(sys, []string{"nvidia_drm", "nvidia-uvm", "video", "nvidia"})
	if err != nil || !slices.Equal(order, []string{"nvidia", "nvidia_uvm"}) {
		t.Errorf("UnloadOrder = %v, %v; want the two loaded modules, nothing built in or absent", order, err)
	}
}

// TestDepthFirst checks the order (each node after what it names, the given order where free,
// names outside the set ignored) and that a cycle is an error naming the kind of edge.
func TestDepthFirst(t *testing.T) {
	edges := map[string][]string{"a": {"c", "outside"}, "b": nil, "c": {"b"}}
	got, err := DepthFirst([]string{"a", "b", "c"}, func(n string) []string { return edges[n] }, "dependency")
	if err != nil || !slices.Equal(got, []string{"b", "c", "a"}) {
		t.Fatalf("DepthFirst = %v, %v; want [b c a]", got, err)
	}
	edges["b"] = []string{"a"}
	_, err = DepthFirst([]string{"a", "b", "c"}, func(n string) []string { return edges[n] }, "holder")
	if err == nil || !strings.Contains(err.Error(), "module holder cycle through ") {
		t.Fatalf("DepthFirst on a cycle = %v, want a module holder cycle error", err)
	}
}
