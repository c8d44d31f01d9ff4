from llmc.formats.cpu_features import cpu_flags, cpu_vendor, native_bf16

# The head of a real /proc/cpuinfo (an AMD EPYC VM's), cut short; a second processor follows.
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs
vmx flags\t: virtual_nmi

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu amx_bf16
"""


def test_the_first_processors_flags_and_vendor_are_read(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert cpu_flags(str(path)) == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
    assert cpu_vendor(str(path)) == "AuthenticAMD"
    assert native_bf16(cpu_flags(str(path))) == ["avx512_bf16"]


def test_an_unreadable_cpuinfo_has_no_flags_and_no_vendor(tmp_path):
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert cpu_vendor(str(tmp_path / "missing")) == ""
