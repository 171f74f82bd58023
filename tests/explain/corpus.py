"""The words of the tools that print them, as each prints them (issue 41): the excerpts
``test_explain_words.py`` explains and ``test_explain_fast.py`` checks RE2 against, every
shape a log gives a line in, and the families that must stay silent."""

from __future__ import annotations

from collections.abc import Callable

Shape = Callable[[str], str]


SHAPES: dict[str, Shape] = {
    "plain": lambda m: m,
    "kubectl --timestamps": lambda m: f"2026-11-21T11:51:41.123456789Z {m}",
    "must-gather --prefix": lambda m: (
        f"[pod/nvidia-driver-daemonset-7xk2p/ctr] 2026-11-21T11:51:41Z {m}"
    ),
    "dmesg": lambda m: f"[  812.345678] {m}",
    "dmesg -T": lambda m: f"[Fri Nov 21 11:51:41 2026] {m}",
    "journalctl": lambda m: f"Nov 21 11:51:41 gpu-1 kernel: {m}",
    "CRLF": lambda m: f"{m}\r\n",
    "ANSI colour": lambda m: f"\x1b[1;31m{m}\x1b[0;39m",
}


# (excerpt, the kind it is): each line as its tool prints it
KERNEL_AND_KMOD: list[tuple[list[str], str]] = [
    (
        [  # CRC mismatch: the kernel's pair, modprobe's EINVAL (gpu-operator#2868)
            "modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument",
            "nvidia_peermem: disagrees about version of symbol ib_register_peer_memory_client",
            "nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -22)",
        ],
        "peermem-abi-mismatch",
    ),
    (  # nv_peer_mem against another NVIDIA driver's symbols (nv_peer_memory#8)
        ["nv_peer_mem: disagrees about version of symbol nvidia_p2p_get_pages"],
        "peermem-abi-mismatch",
    ),
    (  # built for another kernel
        [
            "nvidia_peermem: version magic '5.15.0-91-generic SMP mod_unload modversions ' "
            "should be '5.15.0-94-generic SMP mod_unload modversions '"
        ],
        "peermem-abi-mismatch",
    ),
    (  # err 0: kernels 2.6.35-4.18 for a symbol nobody exports (nv_peer_memory#84)
        ["nv_peer_mem: Unknown symbol ib_register_peer_memory_client (err 0)"],
        "peermem-no-peer-api",
    ),
    (
        ["nvidia_peermem: Unknown symbol ib_register_peer_memory_client (err -2)"],
        "peermem-no-peer-api",
    ),
    (
        ["nv_peer_mem: Unknown symbol ib_unregister_peer_memory_client"],
        "peermem-no-peer-api",
    ),  # 2.6.32
    (
        [  # depmod -e
            "depmod: WARNING: /lib/modules/3.10.0-1127.19.1.el7.x86_64/extra/nv_peer_mem.ko "
            "needs unknown symbol ib_register_peer_memory_client"
        ],
        "peermem-no-peer-api",
    ),
    (["nvidia_peermem: Unknown symbol nvidia_p2p_get_pages (err -2)"], "peermem-no-gpu-driver"),
    (["nvidia_peermem: gave up waiting for init of module ib_core."], "peermem-load-race"),
    (
        ["modprobe: ERROR: could not insert 'nvidia_peermem': Device or resource busy"],
        "peermem-load-race",
    ),
    (
        [
            "modprobe: ERROR: could not insert 'nv_peer_mem': Unknown symbol in module, or "
            "unknown parameter (see dmesg)"
        ],
        "peermem-load-failed",
    ),
    (
        ["insmod: ERROR: could not insert module nvidia-peermem.ko: Invalid parameters"],
        "peermem-einval-unexplained",
    ),
    (
        ["modprobe: can't load module nvidia_peermem (kernel/nvidia-peermem.ko): invalid argument"],
        "peermem-einval-unexplained",
    ),  # busybox
    (
        ["modprobe: FATAL: Module nvidia-peermem not found in directory /lib/modules/5.15.0-91"],
        "peermem-not-built",
    ),
    (  # modprobe -a: the same line as a warning (the driver container's form)
        ["modprobe: WARNING: Module nvidia-peermem not found in directory /lib/modules/6.8.0"],
        "peermem-not-built",
    ),
    (["modinfo: ERROR: Module nvidia-peermem not found."], "peermem-not-built"),
    (  # a storage module of one stack meeting the other (doca-driver-build PR 79)
        ["nvme_rdma: Unknown symbol nvme_init_ctrl_finish (err -22)"],
        "storage-module-other-stack",
    ),
    (
        [
            "rpcrdma: disagrees about version of symbol ib_dealloc_pd_user",
            "rpcrdma: Unknown symbol ib_dealloc_pd_user (err -22)",
        ],
        "storage-module-other-stack",
    ),
    (["rpcrdma: Unknown symbol ib_alloc_cq (err 0)"], "storage-module-other-stack"),  # spdk#684
    (["ib_iser: Unknown symbol __ib_alloc_pd (err -22)"], "storage-module-other-stack"),
    (["ib_srp: disagrees about version of symbol ib_create_cm_id"], "storage-module-other-stack"),
    (
        ["modprobe: ERROR: could not insert 'rpcrdma': Invalid argument"],
        "storage-module-other-stack",
    ),
    (["rmmod: ERROR: Module ib_uverbs is in use by: nvidia_peermem"], "openibd-module-in-use"),
    (["modprobe: FATAL: Module ib_core is in use."], "openibd-module-in-use"),
    (  # any other module of the RDMA stack's users, its builds meeting
        [
            "mlx5_ib: disagrees about version of symbol ib_umem_release",
            "mlx5_ib: Unknown symbol ib_umem_release (err -22)",
        ],
        "rdma-module-other-stack",
    ),
    (["mlx5_vdpa: Unknown symbol mlx5_db_free (err -22)"], "rdma-module-other-stack"),
    (
        [  # the GPUDirect module's own source failing to compile: nothing to load
            "/var/lib/dkms/nv_peer_mem/1.3/build/nv_peer_mem.c:477:15: error: variable "
            "'nv_mem_client_ex' has initializer but incomplete type"
        ],
        "peermem-not-built",
    ),
]


OPENIBD_AND_CONTAINERS: list[tuple[list[str], str]] = [
    (["Loading HCA driver and Access Layer:[FAILED]"], "openibd-restart-failed"),
    (["No HCA kernel modules loaded:[FAILED]"], "openibd-restart-failed"),
    (  # older openibd, modules not built for the running kernel
        ["Module mlx5_core does not exist, skipping...               [FAILED]"],
        "openibd-restart-failed",
    ),
    (
        ["Loading rdma_ucm                                           [FAILED]"],
        "openibd-restart-failed",
    ),
    (["Failed loading kernel module mlx5_ib:[FAILED]"], "openibd-restart-failed"),
    (["Avoid loading inbox module: mlx5_core[FAILED]"], "openibd-restart-failed"),
    (
        [
            "[26-Sep-26_05:02:10] Apply blacklisted mofed modules file to host "
            "(/host/etc/modprobe.d/blacklist-ofed-modules.conf)",
            "Unloading ib_core[FAILED]",
            "rmmod: ERROR: Module ib_core is in use by: nvidia_peermem",
            '[26-Sep-26_05:02:12] Command "/etc/init.d/openibd restart" failed with exit code: 1',
        ],
        "openibd-module-in-use",
    ),
    (
        ['[26-Sep-26_05:02:12] Command "/etc/init.d/openibd restart" failed with exit code: 1'],
        "openibd-restart-failed",
    ),
    (["Error occured while restarting driver"], "openibd-restart-failed"),  # ofed-docker [sic]
    (
        [
            'ERROR\tentrypoint/entrypoint.go:110\texec failed\t{"error": "startErr: failed to '
            'restart driver: failed to restart openibd service: exit status 1, stopErr <nil>"}'
        ],
        "openibd-restart-failed",
    ),
    (
        [
            "Please close all nvme sessions and unload 'nvme_rdma' module.",
            "Error: Cannot unload the Infiniband driver stack due to the above issue(s)!",
        ],
        "storage-blocks-mofed",
    ),
    (
        ["Please make sure module 'rpcrdma' is not in use and unload it."],
        "storage-blocks-mofed",
    ),
    (  # OFED 4.0-4.1's openibd: unquoted, "first", after its "Cannot unload" line
        [
            "Cannot unload driver while nvme_rdma is loaded...",
            "Please close all nvme sessions and unload nvme_rdma module first.",
        ],
        "storage-blocks-mofed",
    ),
    (
        [
            "Cannot unload driver while ib_isert is loaded...",
            "Please close all isert sessions and unload ib_isert module first.",
        ],
        "storage-blocks-mofed",
    ),
    (["Please close all nvmet sessions and unload 'nvmet_rdma' module."], "storage-blocks-mofed"),
    (["Please logout from all open-iscsi over iSER sessions"], "storage-blocks-mofed"),
    (
        [  # the Go entrypoint: lower case, no space after the comma
            'ERROR\tentrypoint/entrypoint.go:308\tkernel modules check failed\t{"error": '
            '"storage modules are loaded for current driver,terminating prior driver reload '
            'failure due to UNLOAD_STORAGE_MODULES not set to \\"true\\""}'
        ],
        "storage-blocks-mofed",
    ),
    (
        [
            "[26-Sep-26_05:02:12] Module nvidia_peermem is used and will FAIL driver reload, "
            "aborting execution."
        ],
        "openibd-module-in-use",
    ),
    (
        [
            "ERROR\tentrypoint/entrypoint.go:290\tfailed to unload nvidia_peermem module\t"
            '{"error": "module is used by other modules: ib_core"}'
        ],
        "openibd-module-in-use",
    ),
    (
        ["starting... Error: the following required module is not loaded: nvidia"],
        "peermem-no-gpu-driver",
    ),
    (["starting... Module nv_peer_mem does not exist"], "peermem-not-built"),
    (["nv_peer_mem.service: Failed with result 'exit-code'."], "peermem-load-failed"),
    (["failed to load nvidia-peermem module"], "peermem-load-failed"),  # the sidecar
]


MOFED = [
    "[21-Nov-26_11:51:06] Unsetting driver ready state",
    "[21-Nov-26_11:51:13] DTK driver build script start",
    "[21-Nov-26_11:58:39] Setting driver ready state",
]


UNRELATED = [
    # Xid and a GPU off the bus
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
    "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)",
    # image pulls
    'Failed to pull image "nvcr.io/nvidia/driver:550.54.15-ubuntu22.04": rpc error: code = '
    "NotFound desc = failed to pull and unpack image",
    'Back-off pulling image "nvcr.io/nvidia/cloud-native/k8s-driver-manager:v0.6.8"',
    "Error: ErrImagePull",
    # NCCL
    "NCCL WARN NET/IB : Got completion from peer 10.0.0.2<45678> with error 12, opcode 0",
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
    "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
    # a driver build that failed for its own reasons
    "Could not resolve Linux kernel version",
    "Unable to install kernel headers for 5.15.0-1040-aws: E: Unable to locate package",
    'ERROR: An error occurred while performing the step: "Building kernel modules".',
    "make[2]: *** [scripts/Makefile.build:286: nvidia/nv.o] Error 1",
    # secure boot, lockdown, signatures: not this tool's incident
    "nvidia: module verification failed: signature and/or required key missing - tainting kernel",
    "Lockdown: modprobe: unsigned module loading is restricted; see man kernel_lockdown.7",
    "modprobe: ERROR: could not insert 'nvidia': Key was rejected by service",
    "modprobe: ERROR: could not insert 'nvidia_peermem': Key was rejected by service",
    "failed to load nvidia-peermem module",
    "modprobe: ERROR: could not insert 'nvidia': Required key not available",
    # another driver's symbols disagreeing (Hyper-V's), and a GPU driver build's error
    "hv_network_direct: disagrees about version of symbol vmbus_sendpacket",
    "hv_network_direct: Unknown symbol vmbus_sendpacket (err -22)",
    "/usr/src/nvidia-550.54.15/kernel/nvidia/nv.c:123:4: error: implicit declaration of "
    "function 'foo'",
    # mlx5 and others that are not ordering failures
    "mlx5_core 0000:01:00.0: mlx5_cmd_out_err:803:(pid 1234): QUERY_HCA_CAP(0x100) op_mod(0x0) "
    "failed, status bad parameter(0x3), syndrome (0x6a7f95), err(-22)",
    "mlx5_core 0000:01:00.0: firmware version: 28.39.1002",
    "Memory cgroup out of memory: Killed process 4242 (python)",
    "dcgm-exporter: Error connecting to nv-hostengine: Host engine connection invalid/disconnected",
    "Could not unload NVIDIA driver kernel modules, driver is in use",
    # the harmless callback of a loaded peermem (nv_peer_memory#120)
    "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping",
    # a successful restart, with its words
    "Loading HCA driver and Access Layer:[  OK  ]",
    "[26-Sep-26_05:03:40] Setting driver ready state",
    "[26-Sep-26_05:03:41] Restoring SR-IOV config for device: 0000:01:00.0 (VFs=4) netdev "
    "name: ens1f0np0",
    "time=2026-08-19T16:33:09Z level=info msg=Waiting for MOFED to be installed...",
    "waiting for mellanox ofed and nvidia drivers to be installed",
    "successfully loaded nvidia-peermem module, now waiting for signal",
    "Starting nginx: [FAILED]",
]


# Other vendors' modules in use: rmmod and modprobe -r print the same words for any module.
OTHER_IN_USE = [
    "rmmod: ERROR: Module snd_hda_intel is in use",
    "modprobe: FATAL: Module zfs is in use.",
    "rmmod: ERROR: Module vboxdrv is in use by: vboxnetflt,vboxnetadp",
    "rmmod: ERROR: Module kvm_intel is in use",
    "Module i915 is in use by: snd_hda_codec_hdmi",
]
