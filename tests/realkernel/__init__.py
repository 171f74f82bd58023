"""Real-kernel test harness: QEMU + a stock Debian kernel (see docs/realkernel.md)."""
