package images

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// values is the part of the gpu-operator chart's values these files set; decoding is strict, so
// a misspelt key fails here instead of being ignored by Helm.
type values struct {
	Driver struct {
		Enabled          bool            `json:"enabled"`
		Repository       string          `json:"repository"`
		Image            string          `json:"image"`
		Version          string          `json:"version"`
		UsePrecompiled   bool            `json:"usePrecompiled"`
		KernelModuleType string          `json:"kernelModuleType,omitempty"`
		Env              []corev1.EnvVar `json:"env"`
		StartupProbe     containerProbe  `json:"startupProbe"`
		Args             []string        `json:"args,omitempty"`
	} `json:"driver"`
	Toolkit struct {
		Enabled    bool   `json:"enabled"`
		InstallDir string `json:"installDir,omitempty"`
	} `json:"toolkit"`
	HostPaths struct {
		RootFS           string `json:"rootFS"`
		DriverInstallDir string `json:"driverInstallDir"`
	} `json:"hostPaths"`
}

// containerProbe is the operator's ContainerProbeSpec.
type containerProbe struct {
	InitialDelaySeconds int32 `json:"initialDelaySeconds"`
	TimeoutSeconds      int32 `json:"timeoutSeconds"`
	PeriodSeconds       int32 `json:"periodSeconds"`
	SuccessThreshold    int32 `json:"successThreshold,omitempty"`
	FailureThreshold    int32 `json:"failureThreshold"`
}

func loadValues(t *testing.T, name string) *values {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(imagesDir, name))
	if err != nil {
		t.Fatal(err)
	}
	var v values
	if err := strictDecode(b, &v); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	// and as plain YAML, the way Helm reads it
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return &v
}

// checkCommon: what both values files need for the operator to run the image.
func checkCommon(t *testing.T, v *values, osTag string) {
	t.Helper()
	d := v.Driver
	if !d.Enabled || d.Repository == "" || d.Image == "" || d.Version == "" {
		t.Errorf("driver.enabled/repository/image/version: %v %q %q %q", d.Enabled, d.Repository, d.Image, d.Version)
	}
	if d.UsePrecompiled {
		t.Error("driver.usePrecompiled is on: the operator would pull NVIDIA's <branch>-<kernel>-<os> tags, which are not built")
	}
	if tag := d.Version + "-" + osTag; !tagRe.MatchString(tag) {
		t.Errorf("a node pulls tag %q, which is not in the scheme scripts/matrix checks", tag)
	}
	if v.HostPaths.DriverInstallDir != "/run/nvidia/driver" || v.HostPaths.RootFS != "/" {
		t.Errorf("hostPaths %+v: the agent shares its root at /run/nvidia/driver", v.HostPaths)
	}
	p := d.StartupProbe
	if p.PeriodSeconds == 0 || p.TimeoutSeconds < 30 || p.InitialDelaySeconds+p.PeriodSeconds*p.FailureThreshold < 20*60 {
		t.Errorf("driver.startupProbe %+v: nvidia-smi needs a long timeout and a compile up to 20 minutes", p)
	}
}

func TestFlatcarValues(t *testing.T) {
	v := loadValues(t, "flatcar/values.yaml")
	checkCommon(t, v, "flatcar4593.2.0")
	if !v.Toolkit.Enabled || v.Toolkit.InstallDir != "/opt/nvidia-runtime" {
		t.Errorf("toolkit %+v: on Flatcar the toolkit must install to /opt/nvidia-runtime (/usr is read-only)", v.Toolkit)
	}
	cfg := agentConfig(t, "flatcar/values.yaml driver.env", v.Driver.Env, nil, v.Driver.Args)
	if cfg.Modules != "auto" {
		t.Errorf("modules %q on Flatcar", cfg.Modules)
	}
	// The operator gives the pod no volume for the cache; it reaches the node's disk through
	// the host root.
	if !strings.HasPrefix(cfg.CacheDir, cfg.HostRoot+"/var/") {
		t.Errorf("cache %q is not on the host's /var under the host root %s", cfg.CacheDir, cfg.HostRoot)
	}
	if cfg.ShutdownTimeout.Seconds() >= 30 {
		t.Errorf("shutdown deadline %s is not under the operator's 30s grace period", cfg.ShutdownTimeout)
	}
}

func TestTalosValues(t *testing.T) {
	v := loadValues(t, "talos/values.yaml")
	checkCommon(t, v, "talosv1.12.0")
	if v.Toolkit.Enabled {
		t.Error("toolkit.enabled: Talos ships the container toolkit as an extension")
	}
	cfg := agentConfig(t, "talos/values.yaml driver.env", v.Driver.Env, nil, v.Driver.Args)
	if cfg.Modules != "host" {
		t.Errorf("modules %q: on Talos the host loads the modules (--modules=host)", cfg.Modules)
	}
}
