// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in for NVIDIA's nvidia-uvm.ko. Not NVIDIA code. */
#include <linux/module.h>

#include "standin.h"

static int __init nvidia_uvm_standin_init(void)
{
	int err = uvm_standin_common_init();

	if (err)
		return err;
	pr_info("nvidia-uvm stand-in: ats %d\n", uvm_standin_ats_supported());
	return nvidia_standin_register_client("nvidia-uvm");
}

static void __exit nvidia_uvm_standin_exit(void)
{
	nvidia_standin_unregister_client("nvidia-uvm");
}

module_init(nvidia_uvm_standin_init);
module_exit(nvidia_uvm_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_VERSION);
MODULE_DESCRIPTION("driver-agent build-test stand-in for NVIDIA nvidia-uvm.ko (not NVIDIA code)");
