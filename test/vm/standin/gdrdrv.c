// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for a module that holds NVIDIA's driver but is not the agent's:
 * GDRCopy's gdrdrv, which the operator's nvidia-gdrcopy-ctr sidecar loads. Not GDRCopy code. It
 * calls nvidia's exported symbols, so it depends on nvidia and shows in
 * /sys/module/nvidia/holders, as the real gdrdrv does.
 */
#include <linux/module.h>

#include "standin.h"

static int __init gdrdrv_standin_init(void)
{
	return nvidia_standin_register_client("gdrdrv");
}

static void __exit gdrdrv_standin_exit(void)
{
	nvidia_standin_unregister_client("gdrdrv");
}

module_init(gdrdrv_standin_init);
module_exit(gdrdrv_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION("2.4-standin");
MODULE_DESCRIPTION("driver-agent VM-test stand-in for GDRCopy's gdrdrv, a holder of nvidia (not GDRCopy code)");
