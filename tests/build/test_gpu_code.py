"""The GPU kernel objects carry machine code for the GPUs the config targets.

Bazel passes the platform (PAGODA_GPU_PLATFORM) and the targets expected
(PAGODA_GPU_TARGETS) in the environment; the objects built by //cuda:kernels
(nvcc) or //cuda:hip_kernels (hipcc) are in the test's runfiles. No GPU is needed: the test reads the
containers the compilers embed in the ELF object: the .nv_fatbin section
(CUDA fat binary: one SASS image per sm_XX target plus PTX) or the .hip_fatbin
section (a clang offload bundle: one code object per gfxNNN target).
"""

import os
import struct
from pathlib import Path

import pytest

PLATFORM = os.environ.get("PAGODA_GPU_PLATFORM", "")
TARGETS = os.environ.get("PAGODA_GPU_TARGETS", "").split()

FATBIN_MAGIC = 0xBA55ED50
FATBIN_PTX, FATBIN_SASS = 1, 2
BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


def elf_sections(path: Path) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not a 64-bit ELF object"
    section_offset = struct.unpack_from("<Q", data, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, section_offset + i * entry_size) for i in range(count)]
    names = headers[names_index]
    name_table = data[names[4] : names[4] + names[5]]
    sections = {}
    for name_offset, _type, _flags, _addr, offset, size in headers:
        name = name_table[name_offset : name_table.index(b"\0", name_offset)].decode()
        sections[name] = data[offset : offset + size]
    return sections


def cuda_images(fatbin: bytes) -> list[tuple[str, int]]:
    """(kind, sm number) of each image in a CUDA fat binary."""
    magic, _version, header_size, size = struct.unpack_from("<IHHQ", fatbin, 0)
    assert magic == FATBIN_MAGIC, f"bad fat binary magic {magic:#x}"
    images, offset = [], header_size
    while offset < header_size + size:
        kind, _version, entry_header, payload = struct.unpack_from("<HHIQ", fatbin, offset)
        sm = struct.unpack_from("<I", fatbin, offset + 28)[0]
        images.append(({FATBIN_PTX: "ptx", FATBIN_SASS: "sass"}.get(kind, str(kind)), sm))
        offset += entry_header + payload
    return images


def hip_targets(bundle: bytes) -> list[str]:
    """Target ids (e.g. hipv4-amdgcn-amd-amdhsa--gfx90a) of a clang offload bundle."""
    assert bundle.startswith(BUNDLE_MAGIC), "not a clang offload bundle"
    (count,) = struct.unpack_from("<Q", bundle, len(BUNDLE_MAGIC))
    targets, offset = [], len(BUNDLE_MAGIC) + 8
    for _ in range(count):
        _code_offset, _code_size, id_size = struct.unpack_from("<QQQ", bundle, offset)
        targets.append(bundle[offset + 24 : offset + 24 + id_size].decode())
        offset += 24 + id_size
    return targets


def objects():
    paths = sorted(Path("cuda").glob(f"_objs/**/*.{PLATFORM}.pic.o"))
    assert paths, f"no {PLATFORM} objects in the runfiles"
    return paths


def test_cuda_sass_for_every_target_and_ptx_for_the_last():
    if PLATFORM != "cuda":
        pytest.skip("CUDA objects only")
    numbers = [target[len("sm_") :] for target in TARGETS]
    for obj in objects():
        fatbin = elf_sections(obj).get(".nv_fatbin")
        assert fatbin is not None, f"{obj} has no .nv_fatbin section"
        images = cuda_images(fatbin)
        for number in numbers:
            assert ("sass", int(number.rstrip("a"))) in images, f"{obj}: no sm_{number} SASS in {images}"
            # Arch-specific targets (sm_90a: wgmma, setmaxnreg) are named in the image options.
            assert f"sm_{number}".encode() in fatbin, f"{obj}: sm_{number} not recorded"
        assert ("ptx", int(numbers[-1].rstrip("a"))) in images, f"{obj}: no PTX for sm_{numbers[-1]} in {images}"


def test_hip_code_object_for_every_target():
    if PLATFORM != "rocm":
        pytest.skip("ROCm objects only")
    for obj in objects():
        bundle = elf_sections(obj).get(".hip_fatbin")
        assert bundle is not None, f"{obj} has no .hip_fatbin section"
        targets = hip_targets(bundle)
        for gfx in TARGETS:
            assert any(t.startswith("hip") and t.endswith("--" + gfx) for t in targets), f"{obj}: no {gfx} in {targets}"

