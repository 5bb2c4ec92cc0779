/* nvml.c — the machine's NVIDIA GPUs and the processes holding their memory, from the
 * driver's management library (NVML), loaded at run time with dlopen and never linked, so
 * vramkit builds and runs where no driver is installed.
 *
 * Only the few NVML types used are defined here, from NVIDIA's documentation of nvml.h; the
 * per-process struct is the trap: its layout depends on which symbol fills it (see
 * process_layout below). Every vram_nvml_* call holds one mutex, which makes loading once,
 * closing and the calls themselves safe from any thread. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

/* ---- NVML's types (only those used) ---- */

typedef int nvml_return_t;                          /* nvmlReturn_t */
typedef struct nvml_device_opaque *nvml_device_t;   /* nvmlDevice_t: an opaque handle */
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
};
#define NVML_TEXT_LEN 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE and NVML_DEVICE_UUID_V2_BUFFER_SIZE */

typedef struct nvml_memory { /* nvmlMemory_t (v1) */
    unsigned long long total, free, used;
} nvml_memory_t;

typedef struct nvml_utilization { /* nvmlUtilization_t */
    unsigned int gpu, memory;
} nvml_utilization_t;

/* nvmlProcessInfo_v1_t: what the unversioned nvmlDevice*RunningProcesses fill. */
typedef struct nvml_process_v1 {
    unsigned int pid;
    unsigned long long used_gpu_memory;
} nvml_process_v1_t;

/* nvmlProcessInfo_v2_t, which is also today's nvmlProcessInfo_t: what the _v2 and _v3 calls fill. */
typedef struct nvml_process_v2 {
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id, compute_instance_id;
} nvml_process_v2_t;

/* The nvmlProcessInfo_t of the drivers that briefly added confidential-computing memory to it:
 * those exporting nvmlDeviceGetConfComputeMemSizeInfo but not yet
 * nvmlDeviceGetRunningProcessDetailList, whose _v3 calls fill this longer struct. */
typedef struct nvml_process_cc {
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id, compute_instance_id;
    unsigned long long used_gpu_cc_protected_memory;
} nvml_process_cc_t;

typedef enum process_layout { LAYOUT_V1, LAYOUT_V2, LAYOUT_CC } process_layout_t;

typedef nvml_return_t (*get_processes_fn)(nvml_device_t, unsigned int *, void *);

/* ---- the loaded library ---- */

enum { KIND_COMPUTE = 0, KIND_GRAPHICS = 1 };

static struct {
    int tried;            /* vram_nvml_open ran (since the last close) */
    vram_status_t status; /* its outcome, returned again by later calls */
    char why[768];        /* its message when it failed */
    void *lib;
    nvml_return_t (*init)(void);
    nvml_return_t (*shutdown)(void);
    nvml_return_t (*count)(unsigned int *);
    nvml_return_t (*handle)(unsigned int, nvml_device_t *);
    nvml_return_t (*name)(nvml_device_t, char *, unsigned int);
    nvml_return_t (*uuid)(nvml_device_t, char *, unsigned int);
    nvml_return_t (*memory)(nvml_device_t, nvml_memory_t *);
    nvml_return_t (*utilization)(nvml_device_t, nvml_utilization_t *);
    const char *(*error_string)(nvml_return_t);
    get_processes_fn processes[2]; /* KIND_COMPUTE, KIND_GRAPHICS */
    const char *process_symbol[2];
    process_layout_t layout[2];
} nv;

static pthread_mutex_t nv_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *DEFAULT_LIBRARY = "libnvidia-ml.so.1";

/* Record the failure of loading, to be returned by every later call until a close. */
__attribute__((format(printf, 2, 3))) static vram_status_t remember(vram_status_t status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(nv.why, sizeof nv.why, fmt, args);
    va_end(args);
    nv.status = status;
    return vram__fail(status, "%s", nv.why);
}

static const char *error_text(nvml_return_t r) {
    const char *text = nv.error_string ? nv.error_string(r) : NULL;
    return text ? text : "unknown error";
}

/* A symbol of the loaded library, or NULL. (POSIX guarantees that a dlsym result converts to a
 * function pointer; the casts below rely on it.) */
static void *symbol(const char *name) { return nv.lib ? dlsym(nv.lib, name) : NULL; }

static void unload(void) {
    if (nv.lib) dlclose(nv.lib);
    nv.lib = NULL;
}

/* The per-process calls, newest first, and the struct layout each fills. */
static const struct {
    const char *name;
    process_layout_t layout;
} PROCESS_SYMBOLS[2][3] = {
    {{"nvmlDeviceGetComputeRunningProcesses_v3", LAYOUT_V2},
     {"nvmlDeviceGetComputeRunningProcesses_v2", LAYOUT_V2},
     {"nvmlDeviceGetComputeRunningProcesses", LAYOUT_V1}},
    {{"nvmlDeviceGetGraphicsRunningProcesses_v3", LAYOUT_V2},
     {"nvmlDeviceGetGraphicsRunningProcesses_v2", LAYOUT_V2},
     {"nvmlDeviceGetGraphicsRunningProcesses", LAYOUT_V1}},
};

/* Choose the newest per-process symbol of one kind. */
static int resolve_processes(int kind) {
    for (int i = 0; i < 3; i++) {
        void *fn = symbol(PROCESS_SYMBOLS[kind][i].name);
        if (!fn) continue;
        nv.processes[kind] = (get_processes_fn)fn;
        nv.process_symbol[kind] = PROCESS_SYMBOLS[kind][i].name;
        nv.layout[kind] = PROCESS_SYMBOLS[kind][i].layout;
        if (i == 0 && symbol("nvmlDeviceGetConfComputeMemSizeInfo") &&
            !symbol("nvmlDeviceGetRunningProcessDetailList"))
            nv.layout[kind] = LAYOUT_CC;
        return 1;
    }
    return 0;
}

static vram_status_t open_locked(void) {
    if (nv.tried) return nv.status == VRAM_OK ? VRAM_OK : vram__fail(nv.status, "%s", nv.why);
    nv.tried = 1;
    const char *override = getenv("VRAMKIT_NVML_LIBRARY");
    int overridden = override && *override;
    const char *path = overridden ? override : DEFAULT_LIBRARY;
    dlerror();
    nv.lib = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
    if (!nv.lib) {
        const char *err = dlerror();
        return remember(VRAM_ERR_UNAVAILABLE, "%s could not be loaded (%s)%s", path, err ? err : "unknown error",
                        overridden ? "; the library was named by VRAMKIT_NVML_LIBRARY" : "");
    }
    static const char *const required[] = {
        "nvmlInit_v2", "nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
        "nvmlErrorString",
    };
    void *found[sizeof required / sizeof required[0]];
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        found[i] = symbol(required[i]);
        if (!found[i]) {
            unload();
            return remember(VRAM_ERR_UNAVAILABLE, "%s has no %s: not an NVML library, or from too old a driver",
                            path, required[i]);
        }
    }
    nv.init = (nvml_return_t (*)(void))found[0];
    nv.shutdown = (nvml_return_t (*)(void))found[1];
    nv.count = (nvml_return_t (*)(unsigned int *))found[2];
    nv.handle = (nvml_return_t (*)(unsigned int, nvml_device_t *))found[3];
    nv.name = (nvml_return_t (*)(nvml_device_t, char *, unsigned int))found[4];
    nv.uuid = (nvml_return_t (*)(nvml_device_t, char *, unsigned int))found[5];
    nv.memory = (nvml_return_t (*)(nvml_device_t, nvml_memory_t *))found[6];
    nv.utilization = (nvml_return_t (*)(nvml_device_t, nvml_utilization_t *))found[7];
    nv.error_string = (const char *(*)(nvml_return_t))found[8];
    for (int kind = KIND_COMPUTE; kind <= KIND_GRAPHICS; kind++) {
        if (!resolve_processes(kind)) {
            unload();
            return remember(VRAM_ERR_UNAVAILABLE, "%s has no %s (_v3, _v2 or unversioned): not an NVML library",
                            path, PROCESS_SYMBOLS[kind][2].name);
        }
    }
    nvml_return_t r = nv.init();
    if (r != NVML_SUCCESS) {
        vram_status_t status = remember(VRAM_ERR_UNAVAILABLE, "nvmlInit_v2 from %s failed: %s (NVML error %d)",
                                        path, error_text(r), r);
        unload();
        return status;
    }
    nv.status = VRAM_OK;
    return VRAM_OK;
}

vram_status_t vram_nvml_open(void) {
    pthread_mutex_lock(&nv_lock);
    vram_status_t status = open_locked();
    pthread_mutex_unlock(&nv_lock);
    return status;
}

void vram_nvml_close(void) {
    pthread_mutex_lock(&nv_lock);
    if (nv.lib) {
        if (nv.status == VRAM_OK) nv.shutdown();
        unload();
    }
    memset(&nv, 0, sizeof nv);
    pthread_mutex_unlock(&nv_lock);
}

static vram_status_t nvml_fail(const char *call, uint32_t index, nvml_return_t r) {
    return vram__fail(VRAM_ERR_BACKEND, "%s failed on GPU %u: %s (NVML error %d)", call, index, error_text(r), r);
}

static vram_status_t count_locked(uint32_t *count) {
    unsigned int n = 0;
    nvml_return_t r = nv.count(&n);
    if (r != NVML_SUCCESS)
        return vram__fail(VRAM_ERR_BACKEND, "nvmlDeviceGetCount_v2 failed: %s (NVML error %d)", error_text(r), r);
    *count = n;
    return VRAM_OK;
}

static vram_status_t handle_locked(uint32_t index, nvml_device_t *out) {
    uint32_t n;
    vram_status_t status = count_locked(&n);
    if (status != VRAM_OK) return status;
    if (index >= n)
        return vram__fail(VRAM_ERR_UNAVAILABLE, "no GPU with NVML index %u: NVML sees %u GPU%s", index, n,
                          n == 1 ? "" : "s");
    nvml_return_t r = nv.handle(index, out);
    return r == NVML_SUCCESS ? VRAM_OK : nvml_fail("nvmlDeviceGetHandleByIndex_v2", index, r);
}

vram_status_t vram_nvml_device_count(uint32_t *count) {
    if (!count) return vram__fail(VRAM_ERR_INVALID_ARG, "vram_nvml_device_count: count is NULL");
    pthread_mutex_lock(&nv_lock);
    vram_status_t status = open_locked();
    if (status == VRAM_OK) status = count_locked(count);
    pthread_mutex_unlock(&nv_lock);
    return status;
}

static vram_status_t info_locked(uint32_t index, vram_gpu_info_t *out) {
    nvml_device_t h;
    vram_status_t status = handle_locked(index, &h);
    if (status != VRAM_OK) return status;
    memset(out, 0, sizeof *out);
    out->index = index;
    char text[NVML_TEXT_LEN];
    nvml_return_t r = nv.name(h, text, sizeof text);
    if (r != NVML_SUCCESS) return nvml_fail("nvmlDeviceGetName", index, r);
    text[sizeof text - 1] = '\0';
    snprintf(out->name, sizeof out->name, "%s", text);
    r = nv.uuid(h, text, sizeof text);
    if (r != NVML_SUCCESS) return nvml_fail("nvmlDeviceGetUUID", index, r);
    text[sizeof text - 1] = '\0';
    snprintf(out->uuid, sizeof out->uuid, "%s", text);
    nvml_memory_t mem;
    r = nv.memory(h, &mem);
    if (r != NVML_SUCCESS) return nvml_fail("nvmlDeviceGetMemoryInfo", index, r);
    out->memory_total = mem.total;
    out->memory_used = mem.used;
    out->memory_free = mem.free;
    nvml_utilization_t util;
    r = nv.utilization(h, &util);
    if (r == NVML_SUCCESS) {
        out->utilization_gpu = (int)util.gpu;
        out->utilization_memory = (int)util.memory;
    } else if (r == NVML_ERROR_NOT_SUPPORTED) { /* MIG, some vGPUs and older boards */
        out->utilization_gpu = out->utilization_memory = -1;
    } else {
        return nvml_fail("nvmlDeviceGetUtilizationRates", index, r);
    }
    return VRAM_OK;
}

vram_status_t vram_nvml_device_info(uint32_t index, vram_gpu_info_t *out) {
    if (!out) return vram__fail(VRAM_ERR_INVALID_ARG, "vram_nvml_device_info: out is NULL");
    pthread_mutex_lock(&nv_lock);
    vram_status_t status = open_locked();
    if (status == VRAM_OK) status = info_locked(index, out);
    pthread_mutex_unlock(&nv_lock);
    return status;
}

static size_t layout_size(process_layout_t layout) {
    switch (layout) {
    case LAYOUT_V1: return sizeof(nvml_process_v1_t);
    case LAYOUT_V2: return sizeof(nvml_process_v2_t);
    case LAYOUT_CC: return sizeof(nvml_process_cc_t);
    }
    return sizeof(nvml_process_cc_t);
}

static vram_gpu_process_t decode(const unsigned char *entry, process_layout_t layout, int kind) {
    vram_gpu_process_t p = {0, kind == KIND_COMPUTE ? VRAM_GPU_PROCESS_COMPUTE : VRAM_GPU_PROCESS_GRAPHICS,
                            VRAM_NVML_NOT_AVAILABLE, VRAM_NVML_NO_ID, VRAM_NVML_NO_ID};
    if (layout == LAYOUT_V1) {
        nvml_process_v1_t e;
        memcpy(&e, entry, sizeof e);
        p.pid = e.pid;
        p.used_memory = e.used_gpu_memory;
    } else { /* the v2 fields lead the longer struct too */
        nvml_process_v2_t e;
        memcpy(&e, entry, sizeof e);
        p.pid = e.pid;
        p.used_memory = e.used_gpu_memory;
        p.gpu_instance_id = e.gpu_instance_id;
        p.compute_instance_id = e.compute_instance_id;
    }
    return p; /* ULLONG_MAX (NVML_VALUE_NOT_AVAILABLE) is VRAM_NVML_NOT_AVAILABLE already */
}

/* Append one kind's processes: ask for the count, then fetch into a larger array (processes
 * may start in between), again while NVML says the array is too small. */
static vram_status_t list_kind(int kind, nvml_device_t h, uint32_t index, vram_gpu_process_t *out, size_t cap,
                               size_t *total) {
    get_processes_fn fn = nv.processes[kind];
    const char *call = nv.process_symbol[kind];
    unsigned int count = 0;
    nvml_return_t r = fn(h, &count, NULL);
    if (r == NVML_SUCCESS) return VRAM_OK; /* none */
    if (r != NVML_ERROR_INSUFFICIENT_SIZE) return nvml_fail(call, index, r);
    size_t stride = layout_size(nv.layout[kind]);
    for (int attempt = 0; attempt < 8; attempt++) {
        unsigned int room = count * 2 + 8;
        unsigned char *buf = calloc(room, stride);
        if (!buf) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for %u NVML process entries", room);
        count = room;
        r = fn(h, &count, buf);
        if (r == NVML_SUCCESS) {
            if (count > room) count = room;
            for (unsigned int i = 0; i < count; i++, (*total)++)
                if (*total < cap) out[*total] = decode(buf + (size_t)i * stride, nv.layout[kind], kind);
            free(buf);
            return VRAM_OK;
        }
        free(buf);
        if (r != NVML_ERROR_INSUFFICIENT_SIZE) return nvml_fail(call, index, r);
    }
    return vram__fail(VRAM_ERR_BACKEND, "%s on GPU %u: the process list kept growing past %u entries", call, index,
                      count);
}

vram_status_t vram_nvml_processes(uint32_t index, vram_gpu_process_t *out, size_t cap, size_t *count) {
    if (!count || (cap && !out))
        return vram__fail(VRAM_ERR_INVALID_ARG, "vram_nvml_processes: %s is NULL", count ? "out" : "count");
    *count = 0;
    pthread_mutex_lock(&nv_lock);
    vram_status_t status = open_locked();
    nvml_device_t h;
    if (status == VRAM_OK) status = handle_locked(index, &h);
    if (status == VRAM_OK) status = list_kind(KIND_COMPUTE, h, index, out, cap, count);
    if (status == VRAM_OK) status = list_kind(KIND_GRAPHICS, h, index, out, cap, count);
    pthread_mutex_unlock(&nv_lock);
    return status;
}
