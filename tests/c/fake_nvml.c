/* fake_nvml.c — a stand-in for libnvidia-ml.so.1, for testing vramkit's NVML code without a GPU.
 *
 * Build: gcc -shared -fPIC -o libfake_nvml.so fake_nvml.c  (tests/unit/test_smi.py does this)
 *   -DFAKE_NVML_NO_V3    export no *RunningProcesses_v3 (the _v2 symbols then serve)
 *   -DFAKE_NVML_ONLY_V1  export only the unversioned *RunningProcesses (nvmlProcessInfo_v1_t)
 * Load it in place of the real library with VRAMKIT_NVML_LIBRARY=/path/libfake_nvml.so.
 *
 * It implements just the functions vramkit calls, with NVML's signatures and return codes, and
 * reads what to report from the text file named by FAKE_NVML_SPEC, again on every call (so a
 * test can change the processes while a process keeps the library open). One item per line;
 * '#' starts a comment; sizes are bytes:
 *
 *   gpu  TOTAL USED UTIL_GPU UTIL_MEM UUID NAME...   a GPU (index = order of the gpu lines); the
 *                                                    utilisations are percents or NA (the call
 *                                                    returns NVML_ERROR_NOT_SUPPORTED); NAME is
 *                                                    the rest of the line; free = TOTAL - USED
 *   proc GPU compute|graphics PID USED               a process on GPU (an index); USED may be NA
 *                                                    (usedGpuMemory = NVML_VALUE_NOT_AVAILABLE)
 *   fail FUNCTION CODE                               FUNCTION returns NVML error CODE
 *                                                    (e.g. "fail nvmlInit_v2 9": driver not loaded)
 *
 * An unreadable spec makes nvmlInit_v2 fail with NVML_ERROR_UNKNOWN. With FAKE_NVML_LOG set,
 * each call appends its function name and a newline to that file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    SUCCESS = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7,
    DRIVER_NOT_LOADED = 9, UNKNOWN = 999,
};
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int gpu, memory; } utilization_t;
typedef struct { unsigned int pid; unsigned long long used; } process_v1_t;
typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } process_v2_t;

#define MAX_GPUS 16
#define MAX_PROCS 512
#define MAX_FAILS 32

typedef struct gpu {
    unsigned long long total, used;
    int util_gpu, util_mem; /* -1: NA */
    char uuid[96], name[96];
} gpu_t;

typedef struct proc {
    int gpu, graphics;
    unsigned int pid;
    unsigned long long used;
} proc_t;

static struct {
    int ok; /* the spec was read */
    int ngpus, nprocs, nfails;
    gpu_t gpus[MAX_GPUS];
    proc_t procs[MAX_PROCS];
    struct { char function[64]; int code; } fails[MAX_FAILS];
} spec;
static int initialised;

static void load(void) {
    memset(&spec, 0, sizeof spec);
    const char *path = getenv("FAKE_NVML_SPEC");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        char word[16], a[64], b[64], c[64], d[64], uuid[96];
        int rest = 0;
        if (sscanf(line, " %15s", word) != 1) continue;
        if (!strcmp(word, "gpu") && spec.ngpus < MAX_GPUS &&
            sscanf(line, " gpu %63s %63s %63s %63s %95s %n", a, b, c, d, uuid, &rest) == 5) {
            gpu_t *g = &spec.gpus[spec.ngpus++];
            g->total = strtoull(a, NULL, 10);
            g->used = strtoull(b, NULL, 10);
            g->util_gpu = strcmp(c, "NA") ? atoi(c) : -1;
            g->util_mem = strcmp(d, "NA") ? atoi(d) : -1;
            snprintf(g->uuid, sizeof g->uuid, "%s", uuid);
            snprintf(g->name, sizeof g->name, "%s", line + rest);
        } else if (!strcmp(word, "proc") && spec.nprocs < MAX_PROCS &&
                   sscanf(line, " proc %63s %63s %63s %63s", a, b, c, d) == 4) {
            proc_t *p = &spec.procs[spec.nprocs++];
            p->gpu = atoi(a);
            p->graphics = !strcmp(b, "graphics");
            p->pid = (unsigned int)strtoul(c, NULL, 10);
            p->used = strcmp(d, "NA") ? strtoull(d, NULL, 10) : NOT_AVAILABLE;
        } else if (!strcmp(word, "fail") && spec.nfails < MAX_FAILS &&
                   sscanf(line, " fail %63s %63s", a, b) == 2) {
            snprintf(spec.fails[spec.nfails].function, sizeof spec.fails[0].function, "%s", a);
            spec.fails[spec.nfails++].code = atoi(b);
        }
    }
    fclose(f);
    spec.ok = 1;
}

/* Log the call, re-read the spec, and return the error the spec sets for this function (0: none). */
static int enter(const char *function) {
    const char *log = getenv("FAKE_NVML_LOG");
    if (log) {
        FILE *f = fopen(log, "a");
        if (f) {
            fprintf(f, "%s\n", function);
            fclose(f);
        }
    }
    load();
    for (int i = 0; i < spec.nfails; i++)
        if (!strcmp(spec.fails[i].function, function)) return spec.fails[i].code;
    return 0;
}

static gpu_t *from_handle(void *handle) {
    for (int i = 0; i < spec.ngpus; i++)
        if (handle == (void *)&spec.gpus[i]) return &spec.gpus[i];
    return NULL;
}

#define ENTER(name)                          \
    do {                                     \
        int forced_ = enter(name);           \
        if (forced_) return forced_;         \
        if (!initialised) return UNINITIALIZED; \
    } while (0)

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    int forced = enter("nvmlInit_v2");
    if (forced) return forced;
    if (!spec.ok) return UNKNOWN;
    initialised = 1;
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    ENTER("nvmlShutdown");
    initialised = 0;
    return SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case SUCCESS: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    case DRIVER_NOT_LOADED: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER("nvmlDeviceGetCount_v2");
    if (!count) return INVALID_ARGUMENT;
    *count = (unsigned int)spec.ngpus;
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    ENTER("nvmlDeviceGetHandleByIndex_v2");
    if (!device || index >= (unsigned int)spec.ngpus) return INVALID_ARGUMENT;
    *device = &spec.gpus[index];
    return SUCCESS;
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int len) {
    if (!out) return INVALID_ARGUMENT;
    if (strlen(text) + 1 > len) return INSUFFICIENT_SIZE;
    memcpy(out, text, strlen(text) + 1);
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int len) {
    ENTER("nvmlDeviceGetName");
    gpu_t *g = from_handle(device);
    return g ? copy_text(g->name, name, len) : INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int len) {
    ENTER("nvmlDeviceGetUUID");
    gpu_t *g = from_handle(device);
    return g ? copy_text(g->uuid, uuid, len) : INVALID_ARGUMENT;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, memory_t *memory) {
    ENTER("nvmlDeviceGetMemoryInfo");
    gpu_t *g = from_handle(device);
    if (!g || !memory) return INVALID_ARGUMENT;
    memory->total = g->total;
    memory->used = g->used;
    memory->free = g->total - g->used;
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(void *device, utilization_t *util) {
    ENTER("nvmlDeviceGetUtilizationRates");
    gpu_t *g = from_handle(device);
    if (!g || !util) return INVALID_ARGUMENT;
    if (g->util_gpu < 0 || g->util_mem < 0) return NOT_SUPPORTED;
    util->gpu = (unsigned int)g->util_gpu;
    util->memory = (unsigned int)g->util_mem;
    return SUCCESS;
}

/* The NVML protocol: too small an array (or none) gives INSUFFICIENT_SIZE and the count needed. */
static nvmlReturn_t processes(const char *function, void *device, unsigned int *count, void *infos, int graphics,
                              int v1) {
    ENTER(function);
    gpu_t *g = from_handle(device);
    if (!g || !count) return INVALID_ARGUMENT;
    int index = (int)(g - spec.gpus);
    unsigned int n = 0;
    for (int i = 0; i < spec.nprocs; i++) n += spec.procs[i].gpu == index && spec.procs[i].graphics == graphics;
    if (n > *count || (n && !infos)) {
        *count = n;
        return INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (int i = 0; i < spec.nprocs; i++) {
        const proc_t *p = &spec.procs[i];
        if (p->gpu != index || p->graphics != graphics) continue;
        if (v1) {
            process_v1_t e = {p->pid, p->used};
            memcpy((char *)infos + k * sizeof e, &e, sizeof e);
        } else {
            process_v2_t e = {p->pid, p->used, 0xFFFFFFFFu, 0xFFFFFFFFu};
            memcpy((char *)infos + k * sizeof e, &e, sizeof e);
        }
        k++;
    }
    *count = n;
    return SUCCESS;
}

#if !defined(FAKE_NVML_NO_V3) && !defined(FAKE_NVML_ONLY_V1)
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetComputeRunningProcesses_v3", d, n, infos, 0, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetGraphicsRunningProcesses_v3", d, n, infos, 1, 0);
}
#endif
#if !defined(FAKE_NVML_ONLY_V1)
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetComputeRunningProcesses_v2", d, n, infos, 0, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetGraphicsRunningProcesses_v2", d, n, infos, 1, 0);
}
#else
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetComputeRunningProcesses", d, n, infos, 0, 1);
}
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(void *d, unsigned int *n, void *infos) {
    return processes("nvmlDeviceGetGraphicsRunningProcesses", d, n, infos, 1, 1);
}
#endif
