// SPDX-License-Identifier: GPL-2.0
/*
 * Stand-in for the core object of NVIDIA's nvidia.ko (nvidia/nv-kernel.o_binary): the tests'
 * helper compiles it once against the kernel headers and ships the object prebuilt, as NVIDIA
 * ships its core. Not NVIDIA code.
 */
#include <linux/printk.h>

#include "standin.h"

int standin_rm_init(void)
{
	pr_info("NVRM: build-test stand-in core loaded\n");
	return 0;
}

void standin_rm_shutdown(void)
{
}
