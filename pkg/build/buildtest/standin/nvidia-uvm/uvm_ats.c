// SPDX-License-Identifier: GPL-2.0
/* Build-test stand-in: a third source file of nvidia-uvm.ko. Not NVIDIA code. */
#include "standin.h"

int uvm_standin_ats_supported(void)
{
	return 0;
}
