// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for NVIDIA's nvidia-modeset.ko: the OS interface half (linked
 * with nvidia-modeset.mod.o it becomes nv-modeset-linux.o). Not NVIDIA code. It calls nvidia's
 * exported symbols, so it depends on nvidia and shows in /sys/module/nvidia/holders.
 */
#include <linux/module.h>

#include "standin.h"

static int __init nvidia_modeset_standin_init(void)
{
	int err = standin_kms_init();

	if (err)
		return err;
	err = nvidia_standin_register_client("nvidia-modeset");
	if (err)
		standin_kms_shutdown();
	return err;
}

static void __exit nvidia_modeset_standin_exit(void)
{
	nvidia_standin_unregister_client("nvidia-modeset");
	standin_kms_shutdown();
}

module_init(nvidia_modeset_standin_init);
module_exit(nvidia_modeset_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_DRIVER_VERSION);
MODULE_DESCRIPTION("driver-agent VM-test stand-in for NVIDIA nvidia-modeset.ko (not NVIDIA code)");
