/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Declarations shared by driver-agent's build-test stand-ins for NVIDIA's kernel modules. They
 * are test fixtures, not NVIDIA code, and drive no hardware. Adapted from test/vm/standin.
 */
#ifndef DRIVER_AGENT_BUILD_STANDIN_H
#define DRIVER_AGENT_BUILD_STANDIN_H

#define STANDIN_VERSION "0.0.1-buildtest"

/* The core objects (prebuilt, like NVIDIA's nv-kernel.o_binary), called by the interface halves. */
int standin_rm_init(void);
void standin_rm_shutdown(void);
int standin_kms_init(void);

/* nvidia.ko exports these; nvidia-uvm and nvidia-modeset use them, so they depend on nvidia. */
int nvidia_standin_register_client(const char *name);
void nvidia_standin_unregister_client(const char *name);

/* nvidia-uvm's parts, one per source file. */
int uvm_standin_common_init(void);
int uvm_standin_ats_supported(void);
const char *nvidia_standin_procfs_name(void);

#endif
