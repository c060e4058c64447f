// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for NVIDIA's nvidia.ko: the OS interface half (linked with
 * nvidia.mod.o it becomes the nv-linux.o of a precompiled package). It is not NVIDIA code and
 * drives no hardware. It shows the agent what it can observe of the real module:
 *  - NVreg_* parameters (read-only in /sys/module/nvidia/parameters) and MODULE_VERSION;
 *  - character major 195 (/dev/nvidiactl is minor 255, /dev/nvidia-modeset 254, /dev/nvidia0 0);
 *    an open file takes a reference on the module, so an open /dev/nvidia0 keeps it loaded;
 *  - /proc/driver/nvidia/version and /proc/driver/nvidia/gpus/<bus id>/information;
 *  - exported symbols that nvidia-uvm and nvidia-modeset use, so they hold nvidia.
 * standin_load_id changes on every load: tests read it to tell a reload from an adoption.
 */
#include <linux/fs.h>
#include <linux/ktime.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>

#include "standin.h"

static int NVreg_EnableGpuFirmware = 18;
module_param(NVreg_EnableGpuFirmware, int, 0444);
MODULE_PARM_DESC(NVreg_EnableGpuFirmware, "GSP firmware mode (stand-in: only stored)");

static int NVreg_OpenRmEnableUnsupportedGpus;
module_param(NVreg_OpenRmEnableUnsupportedGpus, int, 0444);
MODULE_PARM_DESC(NVreg_OpenRmEnableUnsupportedGpus, "stand-in: only stored");

static char *NVreg_RegistryDwords = "";
module_param(NVreg_RegistryDwords, charp, 0444);
MODULE_PARM_DESC(NVreg_RegistryDwords, "stand-in: only stored");

static unsigned int standin_load_id;
module_param(standin_load_id, uint, 0444);
MODULE_PARM_DESC(standin_load_id, "set at load time, different on every load (VM tests)");

static struct proc_dir_entry *proc_nvidia;
static DEFINE_MUTEX(clients_lock);
static unsigned int clients;

static int nv_open(struct inode *inode, struct file *file)
{
	return nonseekable_open(inode, file);
}

static int nv_release(struct inode *inode, struct file *file)
{
	return 0;
}

static const struct file_operations nv_fops = {
	.owner = THIS_MODULE,
	.open = nv_open,
	.release = nv_release,
};

static int version_show(struct seq_file *m, void *v)
{
	seq_printf(m, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  %s  (driver-agent stand-in, %s)\n",
		   STANDIN_DRIVER_VERSION, STANDIN_VARIANT);
	seq_puts(m, "GCC version:  stand-in\n");
	return 0;
}

static int information_show(struct seq_file *m, void *v)
{
	seq_printf(m, "Model: \t\t %s\n", standin_rm_gpu_model());
	seq_puts(m, "IRQ:   \t\t 0\n");
	seq_puts(m, "GPU UUID: \t GPU-00000000-0000-0000-0000-000000000000\n");
	seq_puts(m, "Video BIOS: \t ??.??.??.??.??\n");
	seq_puts(m, "Bus Type: \t PCIe\n");
	seq_printf(m, "Bus Location: \t %s\n", STANDIN_GPU_BUS_ID);
	seq_puts(m, "Device Minor: \t 0\n");
	seq_printf(m, "GPU Firmware: \t %s\n", NVreg_EnableGpuFirmware ? "stand-in" : "N/A");
	seq_puts(m, "GPU Excluded:\t No\n");
	return 0;
}

int nvidia_standin_register_client(const char *name)
{
	mutex_lock(&clients_lock);
	clients++;
	mutex_unlock(&clients_lock);
	pr_info("nvidia stand-in: %s registered\n", name);
	return 0;
}
EXPORT_SYMBOL_GPL(nvidia_standin_register_client);

void nvidia_standin_unregister_client(const char *name)
{
	mutex_lock(&clients_lock);
	clients--;
	mutex_unlock(&clients_lock);
	pr_info("nvidia stand-in: %s unregistered\n", name);
}
EXPORT_SYMBOL_GPL(nvidia_standin_unregister_client);

static int create_proc(void)
{
	struct proc_dir_entry *gpus, *gpu;

	proc_nvidia = proc_mkdir("driver/nvidia", NULL);
	if (!proc_nvidia)
		return -ENOMEM;
	gpus = proc_mkdir("gpus", proc_nvidia);
	gpu = gpus ? proc_mkdir(STANDIN_GPU_BUS_ID, gpus) : NULL;
	if (!proc_create_single("version", 0444, proc_nvidia, version_show) || !gpu ||
	    !proc_create_single("information", 0444, gpu, information_show)) {
		proc_remove(proc_nvidia);
		proc_nvidia = NULL;
		return -ENOMEM;
	}
	return 0;
}

static int __init nvidia_standin_init(void)
{
	int err;

	err = standin_rm_init();
	if (err)
		return err;
	err = register_chrdev(STANDIN_NVIDIA_MAJOR, "nvidia-frontend", &nv_fops);
	if (err < 0)
		goto out_rm;
	err = create_proc();
	if (err)
		goto out_chrdev;
	standin_load_id = (unsigned int)(ktime_get_boottime_ns() / 1000) | 1;
	pr_info("nvidia stand-in %s (%s) loaded: NVreg_EnableGpuFirmware=%d load id %u\n",
		STANDIN_DRIVER_VERSION, STANDIN_VARIANT, NVreg_EnableGpuFirmware, standin_load_id);
	return 0;

out_chrdev:
	unregister_chrdev(STANDIN_NVIDIA_MAJOR, "nvidia-frontend");
out_rm:
	standin_rm_shutdown();
	return err;
}

static void __exit nvidia_standin_exit(void)
{
	proc_remove(proc_nvidia);
	unregister_chrdev(STANDIN_NVIDIA_MAJOR, "nvidia-frontend");
	standin_rm_shutdown();
	pr_info("nvidia stand-in unloaded\n");
}

module_init(nvidia_standin_init);
module_exit(nvidia_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_DRIVER_VERSION);
MODULE_DESCRIPTION("driver-agent VM-test stand-in for NVIDIA nvidia.ko (not NVIDIA code, no GPU support)");
