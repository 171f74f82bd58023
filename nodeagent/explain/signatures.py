"""Which log lines are evidence of what: the table, data only. Each form names the source
of its words (docs/explain-sources.md has each format with its line); the matcher
(``matcher.py``) knows no signature by name, the rules (``rules.py``) read them."""

from __future__ import annotations

import re

from nodeagent.explain.forms import Signature

# The GPUDirect modules: nvidia_peermem (the driver's, since 465) and nv_peer_mem
# (MLNX_OFED's before it, Mellanox/nv_peer_memory), as modprobe, the kernel and a
# file name spell them.
_PEERMEM = r"(?P<module>nvidia[_-]peermem|nv_peer_mem)"
# Storage modules that sit on the RDMA stack and are built for one of its two builds
# (inbox or MOFED): MOFED refuses to install under them (seed 004).
_STORAGE = r"(?P<module>nvme_rdma|nvmet_rdma|rpcrdma|xprtrdma|svcrdma|ib_iser|ib_isert|ib_srpt?)"
# The modules openibd loads and unloads, the storage on them and the GPU's: "is in use"
# names an openibd incident only for one of these (any vendor's rmmod prints the words).
_STACK_MODULE = (
    r"(?:(?:ib|rdma|iw|mlx4|mlx5|nvme|nvmet)_\w+|mlx_compat|mlxfw|mlxdevm|knem|irdma"
    r"|rpcrdma|xprtrdma|svcrdma|nvidia\w*|nv_peer_mem)\b"
)

# What kmod and the kernel print about one module's symbols: "<mod>: ..." (the kernel),
# "<path>/<mod>.ko ..." (depmod)
_SYMBOL_WORDS = (
    r"(?:\.ko)?:? (?P<how>disagrees about version of|Unknown|needs unknown) symbol "
    r"(?P<symbol>\w+)(?: \(err (?P<err>-?\d+)\))?"
)
# Failed inserts: modprobe "could not insert 'mod': strerror" and insmod "could not
# insert module path/mod.ko: strerror" (kmod tools/modprobe.c, tools/insmod.c)
_INSERT = r"could not insert (?:module )?'?(?:[\w./-]{0,200}/)?"


# Where the words come from (docs/explain-sources.md has each format with its line).
KERNEL = "torvalds/linux kernel/module/main.c, version.c (before 5.19: kernel/module.c)"
KMOD = "kmod-project/kmod tools/modprobe.c, insmod.c, rmmod.c, modinfo.c, depmod.c"
BUSYBOX = "busybox modutils/modprobe.c, insmod.c"
OPENIBD = "MLNX_OFED ofed_scripts/openibd (from 25.04: mod_load_funcs)"
DOCA = "Mellanox/doca-driver-build entrypoint.sh (bash) and entrypoint/ (Go)"
OFED_DOCKER = "Mellanox/ofed-docker entrypoint.sh"
GPU_DRIVER = "NVIDIA/gpu-driver-container nvidia-driver (driver container, peermem sidecar)"
DRIVER_MANAGER = "NVIDIA/k8s-driver-manager (init container)"
NV_PEER_MEM = "Mellanox/nv_peer_memory nv_peer_mem init script (the unit systemd makes of it)"

SIGNATURES: tuple[Signature, ...] = (
    # ---- the GPUDirect module's load
    Signature(
        "peermem-einval",
        # EINVAL from finit_module: modprobe prints strerror, insmod "Invalid parameters"
        re.compile(_INSERT + _PEERMEM + r"(?:\.ko)?'?: Invalid (?:argument|parameters)"),
        f"{KMOD}; seeds 000-002; NVIDIA/gpu-operator issue 2868",
        ("could not insert",),
    ),
    Signature(
        "peermem-einval",
        re.compile(
            r"can't (?:insert|load module) '?(?:[\w./-]{0,200}/)?"
            r"(?P<module>nvidia[_-]peermem|nv_peer_mem)[^:]{0,200}: [Ii]nvalid argument"
        ),
        BUSYBOX,
        ("can't insert", "can't load module"),
    ),
    Signature(
        "peermem-symbol",
        # the kernel: "<mod>: disagrees about version of symbol <sym>", "<mod>: Unknown
        # symbol <sym> (err <n>)" (no "(err" before 2.6.35; err %li, 0 for none, to 4.18);
        # depmod -e: "<path>.ko needs unknown symbol <sym>", "... disagrees about ..."
        re.compile(_PEERMEM + _SYMBOL_WORDS),
        f"{KERNEL}; {KMOD} (depmod); NVIDIA/gpu-operator issue 2868",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "peermem-symbol",
        # built for another kernel: "<mod>: version magic '<x>' should be '<y>'"
        re.compile(_PEERMEM + r": (?P<how>version magic) '"),
        KERNEL,
        ("version magic",),
    ),
    Signature(
        "peermem-busy-provider",
        # resolve_symbol_wait: the provider (ib_core) was still in its init after 30 s;
        # then "Unknown symbol <sym> (err -16)" and modprobe's strerror(EBUSY)
        re.compile(_PEERMEM + r": gave up waiting for init of module (?P<provider>\w+)"),
        KERNEL,
        ("gave up waiting for init of module",),
    ),
    Signature(
        "peermem-busy-provider",
        re.compile(
            _INSERT + r"(?:nvidia[_-]peermem|nv_peer_mem)(?:\.ko)?'?: Device or resource busy"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "peermem-not-built",
        # modprobe "Module %s not found in directory %s" (FATAL; WARNING with -a), modinfo
        # "Module %s not found.", busybox "module %s not found in modules.dep", nv_peer_mem's
        # init script "Module nv_peer_mem does not exist"
        re.compile(r"[Mm]odule '?(?:nvidia[_-]peermem|nv_peer_mem)'? (?:not found|does not exist)"),
        f"{KMOD}; {BUSYBOX}; {NV_PEER_MEM}; NVIDIA/gpu-operator issue 2619",
        ("peermem not found", "peer_mem not found", "peermem' not found", "peer_mem does not"),
    ),
    Signature(
        "peermem-not-built",
        # the compiler's error in the GPUDirect module's own source (a DKMS or driver
        # container build): no module comes of it
        re.compile(r"(?:nvidia-peermem|nv_peer_mem)\.c:\d+:\d+: (?:fatal )?error:"),
        "gcc's diagnostics, as DKMS and the driver containers log a build",
        ("peermem.c:", "peer_mem.c:"),
    ),
    Signature(
        "peermem-no-gpu-driver-loaded",
        # nv_peer_mem's init script checks its required modules first
        re.compile(r"required module is not loaded: (?P<provider>nvidia|ib_core)\b"),
        NV_PEER_MEM,
        ("required module is not loaded",),
    ),
    Signature(
        "peermem-load-failed",
        # a failure that does not say why: modprobe's ENOENT text (the kernel's lines name
        # the symbol), the peermem sidecar, nv_peer_mem's script and its unit; each form
        # starts with its fixed text, which the search skips to
        re.compile(
            _INSERT + r"(?:nvidia[_-]peermem|nv_peer_mem)(?:\.ko)?'?: Unknown symbol in module"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "peermem-load-failed",
        re.compile(r"ailed to (?:load|start) (?:nvidia-peermem|nv_peer_mem)"),
        f"{GPU_DRIVER}; {NV_PEER_MEM}",
        ("failed to load nvidia-peermem", "failed to load nv_peer_mem", "to start nv_peer_mem"),
    ),
    Signature(
        "peermem-load-failed",
        re.compile(
            r"nv_peer_mem\.service: Failed with result|Failed to start [^\n]{0,80}nv_peer_mem"
        ),
        NV_PEER_MEM,
        ("nv_peer_mem.service: failed", "nv_peer_mem to start"),
    ),
    Signature(
        "module-signature-rejected",
        # secure boot and lockdown: not this tool's incident; a failed load next to one
        # is not called a GPUDirect failure of unknown cause
        re.compile(
            r"Key was rejected by service|Required key not available"
            r"|unsigned module loading is restricted|Loading of unsigned module is rejected"
        ),
        KERNEL,
        ("could not insert", "can't insert", "unsigned module"),
    ),
    # ---- MOFED's restart, and openibd's own words
    Signature(
        "openibd-failed",
        # openibd's [FAILED] lines (colour and CR taken off; echo loses the label's space)
        re.compile(
            r"(?P<what>Loading HCA driver and Access Layer|No HCA kernel modules loaded"
            r"|Failed loading kernel module [\w.-]{1,64}|Module not found: [\w.-]{1,64}"
            r"|Avoid loading inbox module: [\w.-]{1,64}|(?:Unl|L)oading [\w.-]{1,64}"
            r"|Module [\w.-]{1,64} does not exist, skipping\.{0,3})"
            r":? {0,80}\[ {0,4}FAILED {0,4}\]"
        ),
        OPENIBD,
        ("failed ]", "failed]"),
    ),
    Signature(
        "openibd-failed",
        # a refused stop, and the containers' words for a failed restart
        re.compile(
            r"Cannot unload the Infiniband driver stack"
            r"|Command \"/etc/init\.d/openibd restart\" failed with exit code"
            r"|failed to restart openibd service"
            r"|Error occured while restarting driver"
        ),
        f"{OPENIBD}; {DOCA}; {OFED_DOCKER}",
        ("cannot unload the infiniband", "openibd", "occured while restarting driver"),
    ),
    Signature(
        "openibd-ok",
        re.compile(r"Loading HCA driver and Access Layer: {0,80}\[ {0,4}OK {0,4}\]"),
        OPENIBD,
        ("access layer",),
    ),
    Signature(
        "openibd-trace-exit",
        # the DOCA entrypoint's set -x trace: the exit code exec_cmd kept of its command
        re.compile(r"^\+{1,3} exit_code=(?P<code>\d+)$"),
        DOCA,
        ("exit_code=",),
    ),
    Signature(
        "openibd-restart-begin",
        # the restart as the containers run it: exec_cmd (traced, or its debug line), or
        # ofed-docker's bash -x
        re.compile(
            r"exec_cmd '?/etc/init\.d/openibd restart"
            r"|Executing command: /etc/init\.d/openibd restart"
            r"|^\+{1,3} /etc/init\.d/openibd restart"
        ),
        f"{DOCA}; {OFED_DOCKER}",
        ("openibd restart",),
    ),
    Signature(
        "mofed-restarting",
        re.compile(
            r"Unsetting driver ready state|openibd restart|Waiting for MOFED"
            r"|remove driver ready indicator|driver ready indicator cleared"
            r"|waiting for mellanox ofed and nvidia drivers"
        ),
        f"seeds 000-001; {DOCA}; {DRIVER_MANAGER}; {GPU_DRIVER}",
        (
            "unsetting driver ready state",
            "openibd restart",
            "waiting for mofed",
            "driver ready indicator",
            "waiting for mellanox ofed",
        ),
    ),
    Signature(
        "mofed-ready",
        re.compile(
            r"(?<!Un)[Ss]etting driver ready state|set driver ready indicator"
            r"|driver ready indicator set"
        ),
        f"seed 001; {DOCA}",
        ("setting driver ready state", "driver ready indicator"),
    ),
    # ---- storage modules
    Signature(
        "storage-modules-loaded",
        # bash: "Storage modules are loaded for current driver, terminating ..."; Go:
        # "storage modules are loaded for current driver,terminating ..."
        re.compile(r"[Ss]torage modules are loaded for current driver"),
        f"seed 004; Mellanox/network-operator issue 1084; {DOCA}",
        ("storage modules are loaded for current driver",),
    ),
    Signature(
        "storage-modules-loaded",
        # openibd refusing to stop under a storage module in use; OFED 4.0-4.1 said it
        # unquoted, "... unload nvme_rdma module first.", after "Cannot unload driver
        # while nvme_rdma is loaded..." (docs/explain-sources.md)
        re.compile(
            r"Please close all nvmet? sessions and unload '?(?P<module>nvmet?_rdma)\b"
            r"|Please close all isert sessions and unload '?ib_isert\b"
            r"|Please make sure module '(?P<m2>rpcrdma|xprtrdma|ib_srpt)' is not in use"
            r"|Please logout from all open-iscsi over iSER sessions"
            r"|Please flush multipath devices running over SRP devices"
            r"|Cannot unload driver while (?P<m3>ib_isert|nvmet?_rdma) is loaded"
        ),
        OPENIBD,
        (
            "please close all",
            "please make sure module",
            "over iser sessions",
            "over srp devices",
            "cannot unload driver while",
        ),
    ),
    Signature(
        "storage-symbol",
        re.compile(r"\b" + _STORAGE + _SYMBOL_WORDS),
        f"{KERNEL}; {KMOD} (depmod); Mellanox/doca-driver-build PR 79; spdk/spdk issue 684",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "storage-symbol",
        re.compile(
            _INSERT + _STORAGE + r"(?:\.ko)?'?: (?P<how>Invalid argument|Unknown symbol in module)"
        ),
        KMOD,
        ("could not insert",),
    ),
    Signature(
        "rdma-symbol",
        # any other module that takes RDMA-stack or mlx5 symbols (mlx5_ib, mlx5_vdpa, an
        # SMB-Direct or DRBD transport...): the same meeting of the two stacks' builds
        re.compile(
            r"(?<!\S)(?P<module>\w+)(?:\.ko)?:? (?P<how>disagrees about version of|Unknown) "
            r"symbol (?P<symbol>(?:__)?(?:ib|rdma|mlx5|mlx4|iw|uverbs|mlxfw)_\w+)"
            r"(?: \(err (?P<err>-?\d+)\))?"
        ),
        f"{KERNEL}; Mellanox/doca-driver-build PR 51 (mlx5_vdpa), issue 52 (mlx5_ib)",
        ("disagrees about version of symbol", "unknown symbol"),
    ),
    Signature(
        "module-in-use",
        # rmmod "Module %s is in use by: ..." (garbled after "by:" in kmod 34), "Module %s is
        # in use"; modprobe -r "Module %s is in use." Only where the module, or what holds
        # it, is of the RDMA stack, its storage or the GPU's: any vendor's module prints it.
        re.compile(
            rf"Module (?:{_STACK_MODULE}) is in use(?: by:? ?\S+)?"
            rf"|Module \w+ is in use by:? ?(?:{_STACK_MODULE})"
        ),
        f"{KMOD} (rmmod, modprobe -r); Mellanox/doca-driver-build PR 481",
        (" is in use",),
    ),
    Signature(
        "module-in-use",
        # the DOCA container refusing before its restart: nvidia_peermem is in use
        re.compile(
            r"Module (nvidia_peermem) is used and will FAIL driver reload"
            r"|failed to unload (nvidia_peermem) module"
        ),
        DOCA,
        ("nvidia_peermem",),
    ),
    Signature(
        "vf-no-netdev",
        re.compile(r'Cannot find device "?([\w.-]+)"?'),
        "seed 003 (MOFED's restore_sriov_config)",
        ("cannot find device",),
    ),
    Signature(
        "vf-no-netdev",
        # /sys/\S*/net/? not found, reversed: from " not found" back over the path to
        # the first /sys/ in it (was searched forwards: 0.5 MB/s on lines of /sys/)
        re.compile(r"dnuof ton /?ten/\S*?/sys/"),
        "seed 003 (MOFED's restore_sriov_config)",
        ("/net not found", "/net/ not found"),
        backward=True,
    ),
    # (?i)VF restore(?:\W+\w+)?\W+FAIL|restore_sriov_config, as two forms whose first
    # letter is a class ([Vv], [Rr]: all that (?i) takes for V, R), so the search skips
    # to it instead of trying the case-blind branches at every character. The first
    # \W+ taken once, before the optional word (the same lines); \W and \w take no
    # character of each other (nor F), so giving any back never helps (++)
    Signature(
        "vf-restore-failed",
        re.compile(r"[Vv](?i:F restore\W++(?:\w++\W++)?FAIL)"),
        "seed 003",
        ("vf re",),
    ),
    Signature(
        "vf-restore-failed",
        re.compile(r"[Rr](?i:estore_sriov_config)"),
        "seed 003",
        # none of these letters has a case-blind match that lower() does not turn into
        # it (s has: U+017F; i has: U+0131); tests/explain/test_explain_linear.py checks
        ("tore",),
    ),
    Signature(
        "peermem-harmless-callback",
        # nv_get_p2p_free_callback.*invalid context, from the first callback name on
        # the line only (atomic): searched from each one, each .* re-ran to the end
        re.compile(r"(?m)^(?>.*?nv_get_p2p_free_callback).*invalid context"),
        "Mellanox/nv_peer_memory issue 120 (a loaded peermem's runtime message: harmless)",
        ("nv_get_p2p_free_callback",),
    ),
)


# Cheap before any per-line work: a chunk without one of these words (in any case) has no
# evidence (``may_have_evidence``: one RE2 pass; Python's re runs such an alternation at
# ~20 MB/s). Each signature's lines have one of them (tests/explain/test_explain_linear.py
# checks): not its own ``needs``, some of which ("tore") are in most chunks.
PREFILTER_WORDS = (
    b"peermem",
    b"peer_mem",
    b"t insert",  # could not insert, can't insert
    b"t load module",
    b"symbol",  # unknown symbol, disagrees about version of symbol, needs unknown symbol
    b"version magic",
    b"gave up waiting",
    b"required module is",
    b"unsigned module",
    b"storage modules",
    b"please close all",
    b"cannot unload driver while",
    b"please make sure module",
    b"over iser sessions",
    b"over srp devices",
    b"is in use",
    b"openibd",
    b"access layer",
    b"failed]",
    b"failed ]",
    b"cannot unload the infiniband",
    b"occured while restarting",
    b"exit_code=",
    b"driver ready",  # state, indicator
    b"waiting for mofed",
    b"waiting for mellanox",
    b"cannot find device",
    b"restore",
    b"/net not found",
    b"/net/ not found",
)
