// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in: a second source file of nvidia-uvm.ko. Not NVIDIA code. */
#include "standin.h"

int uvm_standin_common_init(void)
{
	return 0;
}
