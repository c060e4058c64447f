// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in for NVIDIA's nvidia-peermem.ko. Not NVIDIA code. */
#include <linux/module.h>

#include "standin.h"

static int __init nvidia_peermem_standin_init(void)
{
	return 0;
}

static void __exit nvidia_peermem_standin_exit(void)
{
}

module_init(nvidia_peermem_standin_init);
module_exit(nvidia_peermem_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_VERSION);
MODULE_DESCRIPTION("driver-agent build-test stand-in for NVIDIA nvidia-peermem.ko (not NVIDIA code)");
