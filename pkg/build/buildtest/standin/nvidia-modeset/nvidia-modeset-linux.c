// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in for NVIDIA's nvidia-modeset.ko, interface half. Not NVIDIA code. */
#include <linux/module.h>

#include "standin.h"

static int __init nvidia_modeset_standin_init(void)
{
	int err = standin_kms_init();

	if (err)
		return err;
	return nvidia_standin_register_client("nvidia-modeset");
}

static void __exit nvidia_modeset_standin_exit(void)
{
	nvidia_standin_unregister_client("nvidia-modeset");
}

module_init(nvidia_modeset_standin_init);
module_exit(nvidia_modeset_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_VERSION);
MODULE_DESCRIPTION("driver-agent build-test stand-in for NVIDIA nvidia-modeset.ko (not NVIDIA code)");
