"""Which OpenBLAS the CPU preload finds (the library is loaded before mlx.core)."""

from turboquant import cpu_blas


def test_openblas_of_either_opencv_wheel_is_found(tmp_path, monkeypatch):
    """A plain install has only opencv-python-headless (rapidocr's); without its
    OpenBLAS, MLX's CPU matmuls fall back to the ~40x slower reference BLAS."""
    for wheel in ("opencv_python.libs", "opencv_python_headless.libs"):
        (tmp_path / wheel).mkdir()
        (tmp_path / wheel / "libopenblasp-r0-x.3.15.so").write_bytes(b"")
    monkeypatch.delenv("TQ_OPENBLAS", raising=False)
    monkeypatch.setattr(cpu_blas.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    found = cpu_blas._candidates()
    assert str(tmp_path / "opencv_python.libs" / "libopenblasp-r0-x.3.15.so") in found
    assert str(tmp_path / "opencv_python_headless.libs" / "libopenblasp-r0-x.3.15.so") in found


def test_explicit_library_wins(monkeypatch):
    monkeypatch.setenv("TQ_OPENBLAS", "/opt/lib/libopenblas.so")
    assert cpu_blas._candidates() == ["/opt/lib/libopenblas.so"]
