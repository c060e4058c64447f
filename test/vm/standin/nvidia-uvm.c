// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for NVIDIA's nvidia-uvm.ko (shipped as a complete module in a
 * precompiled package). Not NVIDIA code. It registers a dynamic character major named
 * "nvidia-uvm" (minor 0 is /dev/nvidia-uvm, 1 /dev/nvidia-uvm-tools) and calls nvidia's
 * exported symbols, so it depends on nvidia and shows in /sys/module/nvidia/holders.
 */
#include <linux/fs.h>
#include <linux/module.h>

#include "standin.h"

static int uvm_major;

static int uvm_open(struct inode *inode, struct file *file)
{
	return nonseekable_open(inode, file);
}

static const struct file_operations uvm_fops = {
	.owner = THIS_MODULE,
	.open = uvm_open,
};

static int __init nvidia_uvm_standin_init(void)
{
	int err = nvidia_standin_register_client("nvidia-uvm");

	if (err)
		return err;
	uvm_major = register_chrdev(0, "nvidia-uvm", &uvm_fops);
	if (uvm_major < 0) {
		nvidia_standin_unregister_client("nvidia-uvm");
		return uvm_major;
	}
	return 0;
}

static void __exit nvidia_uvm_standin_exit(void)
{
	unregister_chrdev(uvm_major, "nvidia-uvm");
	nvidia_standin_unregister_client("nvidia-uvm");
}

module_init(nvidia_uvm_standin_init);
module_exit(nvidia_uvm_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_DRIVER_VERSION);
MODULE_DESCRIPTION("driver-agent VM-test stand-in for NVIDIA nvidia-uvm.ko (not NVIDIA code)");
