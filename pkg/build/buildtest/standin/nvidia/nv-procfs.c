// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in: a second source file of nvidia.ko. Not NVIDIA code. */
#include "standin.h"

const char *nvidia_standin_procfs_name(void)
{
	return "driver/nvidia (stand-in)";
}
