/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Declarations shared by the driver-agent VM-test stand-ins for NVIDIA's kernel modules.
 * These are test fixtures, not NVIDIA code: they drive no hardware.
 *
 * standin-config.h is written by the harness (test/vm) next to the sources before kbuild runs:
 *   STANDIN_DRIVER_VERSION  the test's DRIVER_VERSION, e.g. "580.95.05" (MODULE_VERSION)
 *   STANDIN_VARIANT         a name for the build, e.g. "standard", "enodev", "slow"
 *   STANDIN_INIT_ENODEV     1: the core's init fails with -ENODEV, as nvidia.ko does without a GPU
 *   STANDIN_INIT_DELAY_MS   > 0: the core's init sleeps that long first (SIGTERM-during-load tests)
 */
#ifndef DRIVER_AGENT_STANDIN_H
#define DRIVER_AGENT_STANDIN_H

#include "standin-config.h"

/* NVIDIA's fixed character major and the stand-in GPU's PCI address. */
#define STANDIN_NVIDIA_MAJOR 195
#define STANDIN_GPU_BUS_ID "0000:01:00.0"

/* The nvidia core object (stands in for nv-kernel.o_binary); called by the interface half. */
int standin_rm_init(void);
void standin_rm_shutdown(void);
const char *standin_rm_gpu_model(void);

/* The nvidia-modeset core object (stands in for nv-modeset-kernel.o_binary). */
int standin_kms_init(void);
void standin_kms_shutdown(void);

/* Exported by nvidia for nvidia-uvm and nvidia-modeset: calling them makes those modules depend
 * on nvidia by symbol, so the kernel lists them in /sys/module/nvidia/holders. */
int nvidia_standin_register_client(const char *name);
void nvidia_standin_unregister_client(const char *name);

#endif
