/*
 * A stand-in for a kernel module, compiled with "gcc -c" by the tests: it has
 * the sections and symbols a real .ko has (.modinfo, __ksymtab*, __versions)
 * without needing kernel headers.
 */
#define MODINFO(id, s) \
	static const char __modinfo_##id[] \
	__attribute__((section(".modinfo"), used, aligned(1))) = s

MODINFO(version, "version=535.309.01");
MODINFO(license, "license=Dual MIT/GPL");
MODINFO(description, "description=Fake NVIDIA module");
MODINFO(firmware1, "firmware=nvidia/535.309.01/gsp_ga10x.bin");
MODINFO(firmware2, "firmware=nvidia/535.309.01/gsp_tu10x.bin");
MODINFO(parm1, "parm=NVreg_EnableGpuFirmware:Enable GSP firmware (0 = off)");
MODINFO(parmtype1, "parmtype=NVreg_EnableGpuFirmware:int");
MODINFO(parmtype2, "parmtype=NVreg_RegistryDwords:charp");
MODINFO(parm3, "parm=debug:Enable debug output: yes or no");
MODINFO(parmtype3, "parmtype=debug:bool");
MODINFO(alias1, "alias=pci:v000010DEd*sv*sd*bc03sc00i00*");
MODINFO(alias2, "alias=pci:v000010DEd*sv*sd*bc03sc02i00*");
MODINFO(depends, "depends=drm,video");
MODINFO(srcversion, "srcversion=0123456789ABCDEF0123456");
MODINFO(name, "name=nvidia");
MODINFO(vermagic, "vermagic=6.1.0-57-amd64 SMP preempt mod_unload modversions ");

extern int _printk(const char *fmt, ...);
extern void drm_gem_object_free(void *obj);
extern void optional_hook(void) __attribute__((weak));

int nv_fake_export(void)
{
	_printk("nvidia: hello\n");
	drm_gem_object_free(0);
	if (optional_hook)
		optional_hook();
	return 0;
}

int nv_fake_gpl_export(void)
{
	return 1;
}

#define KSYMTAB(sym, sec, ns) \
	static const char __kstrtab_##sym[] \
	__attribute__((section("__ksymtab_strings"), used, aligned(1))) = #sym; \
	static const char __kstrtabns_##sym[] \
	__attribute__((section("__ksymtab_strings"), used, aligned(1))) = ns; \
	const int __ksymtab_##sym[3] \
	__attribute__((section("___ksymtab" sec "+" #sym), used)) = { 0, 0, 0 }

KSYMTAB(nv_fake_export, "", "");
KSYMTAB(nv_fake_gpl_export, "_gpl", "NVIDIA_NS");

struct modversion_info {
	unsigned long crc;
	char name[64 - sizeof(unsigned long)];
};

static const struct modversion_info ____versions[]
__attribute__((used, section("__versions"))) = {
	{ 0x92997ed8, "_printk" },
	{ 0x1c7f9b1a, "drm_gem_object_free" },
};

/* Extended modversions (Linux 6.13+): names too long for __versions. */
static const char ext_names[]
__attribute__((used, section("__version_ext_names"), aligned(1))) =
	"_RNvNtCs1234_6kernel5print11call_printk\0drm_gem_object_free";
static const unsigned int ext_crcs[]
__attribute__((used, section("__version_ext_crcs"))) = { 0xdeadbeef, 0x1c7f9b1a };
