// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for the core object of NVIDIA's nvidia.ko (the file NVIDIA ships
 * as nvidia/nv-kernel.o_binary). It is not NVIDIA code and drives no hardware. The harness links
 * it into nvidia.ko the way NVIDIA's installer does (`ld -d -r -o nvidia.ko nv-linux.o
 * nv-kernel.o_binary`), and builds variants whose init fails with -ENODEV or sleeps first.
 */
#include <linux/delay.h>
#include <linux/errno.h>
#include <linux/printk.h>

#include "standin.h"

int standin_rm_init(void)
{
	if (STANDIN_INIT_DELAY_MS > 0) {
		pr_info("NVRM: stand-in core (%s): sleeping %d ms in init\n", STANDIN_VARIANT,
			STANDIN_INIT_DELAY_MS);
		msleep(STANDIN_INIT_DELAY_MS);
	}
	if (STANDIN_INIT_ENODEV) {
		/* The message the real core logs when it finds no GPU. */
		pr_info("NVRM: No NVIDIA GPU found.\n");
		return -ENODEV;
	}
	return 0;
}

void standin_rm_shutdown(void)
{
}

const char *standin_rm_gpu_model(void)
{
	return "NVIDIA Stand-in GPU (driver-agent VM test, " STANDIN_VARIANT ")";
}
