"""The CPU every figure names (shared by the benchmark scripts; this folder is on sys.path when
they run): lscpu's model name with its family and model, e.g. "Intel(R) Xeon(R) Processor
(family 6 model 167)"."""

import platform


def cpu_name():
    """Model name, family and model of the first CPU in /proc/cpuinfo (else what platform
    knows, or "unknown CPU")."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name
