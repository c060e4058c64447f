package hosttest

import (
	"github.com/driver-agent/driver-agent/pkg/modfile"
	"testing"
)

func TestModuleELF(t *testing.T) {
	info, err := modfile.Info(ModuleELF("name=nvidia_uvm", "version=1.2", "depends=nvidia,i2c_core"))
	if err != nil || info.Name != "nvidia_uvm" || info.Version != "1.2" || len(info.Depends) != 2 {
		t.Fatalf("%+v %v", info, err)
	}
}
