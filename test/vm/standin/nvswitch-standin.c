// SPDX-License-Identifier: GPL-2.0
/*
 * driver-agent VM-test stand-in for the NVSwitch part of NVIDIA's driver. Not NVIDIA code; it
 * drives no hardware. On an HGX board with NVSwitches, NVIDIA's driver lists each switch under
 * /proc/driver/nvidia-nvswitch/devices/<PCI address>/, and a non-empty devices directory is how
 * the agent (like NVIDIA's script) decides to run nv-fabricmanager. This module makes that
 * directory with two switches, each with an "information" file.
 */
#include <linux/module.h>
#include <linux/proc_fs.h>
#include <linux/seq_file.h>

#include "standin.h"

static const char *const switches[] = { "0000:c1:00.0", "0000:c2:00.0" };
static struct proc_dir_entry *proc_nvswitch;

static int information_show(struct seq_file *m, void *v)
{
	seq_printf(m, "Model:\t\t NVSwitch (driver-agent VM-test stand-in)\nBus Location:\t %s\nDriver:\t\t %s\n",
		   (const char *)m->private, STANDIN_DRIVER_VERSION);
	return 0;
}

static int __init nvswitch_standin_init(void)
{
	struct proc_dir_entry *devices, *dev;
	int i;

	proc_nvswitch = proc_mkdir("driver/nvidia-nvswitch", NULL);
	if (!proc_nvswitch)
		return -ENOMEM;
	devices = proc_mkdir("devices", proc_nvswitch);
	if (!devices)
		goto fail;
	for (i = 0; i < ARRAY_SIZE(switches); i++) {
		dev = proc_mkdir(switches[i], devices);
		if (!dev || !proc_create_single_data("information", 0444, dev, information_show, (void *)switches[i]))
			goto fail;
	}
	return 0;
fail:
	proc_remove(proc_nvswitch);
	return -ENOMEM;
}

static void __exit nvswitch_standin_exit(void)
{
	proc_remove(proc_nvswitch);
}

module_init(nvswitch_standin_init);
module_exit(nvswitch_standin_exit);

MODULE_LICENSE("GPL");
MODULE_VERSION(STANDIN_DRIVER_VERSION);
MODULE_DESCRIPTION("driver-agent VM-test stand-in for NVIDIA's NVSwitch procfs entries (not NVIDIA code)");
