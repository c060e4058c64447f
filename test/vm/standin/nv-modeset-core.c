// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for the core object of NVIDIA's nvidia-modeset.ko (the file
 * NVIDIA ships as nvidia-modeset/nv-modeset-kernel.o_binary). Not NVIDIA code.
 */
#include <linux/printk.h>

#include "standin.h"

int standin_kms_init(void)
{
	return 0;
}

void standin_kms_shutdown(void)
{
}
