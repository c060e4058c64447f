// SPDX-License-Identifier: GPL-2.0
/*
 * Build-test stand-in for NVIDIA's nvidia.ko, interface half: module init and exit, a parameter,
 * and the symbols nvidia-uvm and nvidia-modeset use. Not NVIDIA code.
 */
#include <linux/module.h>
#include <linux/moduleparam.h>

#include "standin.h"

static int NVreg_EnableGpuFirmware = 18;
module_param(NVreg_EnableGpuFirmware, int, 0444);
MODULE_PARM_DESC(NVreg_EnableGpuFirmware, "stand-in: only stored");

static unsigned int clients;

int nvidia_standin_register_client(const char *name)
{
	clients++;
	pr_info("nvidia stand-in: client %s\n", name);
	return 0;
}
EXPORT_SYMBOL(nvidia_standin_register_client);

void nvidia_standin_unregister_client(const char *name)
{
	clients--;
}
EXPORT_SYMBOL(nvidia_standin_unregister_client);

static int __init nvidia_standin_init(void)
{
	pr_info("nvidia stand-in: %s\n", nvidia_standin_procfs_name());
	return standin_rm_init();
}

static void __exit nvidia_standin_exit(void)
{
	standin_rm_shutdown();
}

module_init(nvidia_standin_init);
module_exit(nvidia_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_VERSION);
MODULE_DESCRIPTION("driver-agent build-test stand-in for NVIDIA nvidia.ko (not NVIDIA code)");
