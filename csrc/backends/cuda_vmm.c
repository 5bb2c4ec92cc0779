/* cuda_vmm.c — expandable segments on CUDA: address ranges reserved with the driver's
 * virtual-memory API (cuMemAddressReserve) and backed page by page with cuMemCreate + cuMemMap.
 *
 * The runtime has no such calls, so the driver library is opened here with dlopen, once, and
 * never linked: the module must import where no driver is installed. cuda.h is included for
 * its types and enums only; the symbols are looked up by literal name, so its
 * `#define cuFoo cuFoo_v2` macros do not apply (none of the calls used here is versioned as
 * of CUDA 13.0). The runtime opens the same libcuda.so.1, so both share one driver state:
 * cuInit has run by the time a ctx exists (vram_backend_cuda_ctx asks for the device count). */
#ifdef VRAMKIT_WITH_CUDA
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "../util/error.h"
#include "cuda_vmm.h"

#define DRIVER_LIBRARY "libcuda.so.1"
#define RESERVE_ALIGNMENT ((size_t)2 << 20) /* the pool's contract: ranges aligned to 2 MiB */

typedef CUresult (*reserve_fn)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*address_free_fn)(CUdeviceptr, size_t);
typedef CUresult (*create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*set_access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*granularity_fn)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*error_text_fn)(CUresult, const char **);
typedef CUresult (*current_context_fn)(CUcontext *);

/* Written once under drv_once, read-only afterwards: no lock needed on the calls. */
static struct {
    vram_status_t status;
    char why[512]; /* the loading failure, repeated by every later call */
    reserve_fn reserve;
    address_free_fn address_free;
    create_fn create;
    release_fn release;
    map_fn map;
    unmap_fn unmap;
    set_access_fn set_access;
    granularity_fn granularity;
    error_text_fn error_name, error_string;
    current_context_fn current_context;
} drv;

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* A symbol of `lib`, or NULL with the first missing name kept in *missing. (POSIX guarantees
 * that a dlsym result converts to a function pointer; the casts below rely on it.) */
static void *need(void *lib, const char *name, const char **missing) {
    void *p = dlsym(lib, name);
    if (!p && !*missing) *missing = name;
    return p;
}

static void load_symbols(void *lib, const char **missing) {
    drv.reserve = (reserve_fn)need(lib, "cuMemAddressReserve", missing);
    drv.address_free = (address_free_fn)need(lib, "cuMemAddressFree", missing);
    drv.create = (create_fn)need(lib, "cuMemCreate", missing);
    drv.release = (release_fn)need(lib, "cuMemRelease", missing);
    drv.map = (map_fn)need(lib, "cuMemMap", missing);
    drv.unmap = (unmap_fn)need(lib, "cuMemUnmap", missing);
    drv.set_access = (set_access_fn)need(lib, "cuMemSetAccess", missing);
    drv.granularity = (granularity_fn)need(lib, "cuMemGetAllocationGranularity", missing);
    drv.error_name = (error_text_fn)need(lib, "cuGetErrorName", missing);
    drv.error_string = (error_text_fn)need(lib, "cuGetErrorString", missing);
    drv.current_context = (current_context_fn)need(lib, "cuCtxGetCurrent", missing);
}

/* On success the library stays open for the life of the process (the runtime holds it too). */
static void load_once(void) {
    drv.status = VRAM_ERR_UNAVAILABLE;
    void *lib = dlopen(DRIVER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(drv.why, sizeof drv.why,
                 "expandable segments on cuda need the NVIDIA driver's " DRIVER_LIBRARY ", which could not be "
                 "loaded: %s", why ? why : "unknown reason");
        return;
    }
    const char *missing = NULL;
    load_symbols(lib, &missing);
    if (missing) {
        snprintf(drv.why, sizeof drv.why,
                 "expandable segments on cuda need %s, which " DRIVER_LIBRARY " does not export: the NVIDIA "
                 "driver is too old for the virtual-memory API", missing);
        dlclose(lib);
        return;
    }
    drv.status = VRAM_OK;
}

vram_status_t vram__cuda_vmm_load(void) {
    pthread_once(&drv_once, load_once);
    return drv.status == VRAM_OK ? VRAM_OK : vram__fail(drv.status, "%s", drv.why);
}

int vram__cuda_vmm_no_context(void) {
    CUcontext current = NULL;
    return drv.current_context(&current) != CUDA_SUCCESS || current == NULL;
}

/* Same shape as cuda.c's cuda_fail, with the driver's own name and text for the error. */
static vram_status_t driver_fail(const char *call, int device, CUresult r) {
    const char *name = NULL, *text = NULL;
    char unknown[32];
    if (drv.error_name(r, &name) != CUDA_SUCCESS || !name) {
        snprintf(unknown, sizeof unknown, "CUresult %d", (int)r);
        name = unknown;
    }
    if (drv.error_string(r, &text) != CUDA_SUCCESS || !text) text = "no description";
    return vram__fail(VRAM_ERR_BACKEND, "%s failed on cuda:%d: %s (%s)", call, device, name, text);
}

static CUmemLocation on_device(int device) {
    CUmemLocation where = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
    return where;
}

/* A reserve failure carries a message even for CUDA_ERROR_OUT_OF_MEMORY: that means the
 * process is out of addresses, not the device out of memory, and the pool passes it on as is. */
vram_status_t vram__cuda_vmm_reserve(int device, uint64_t size, uintptr_t *out) {
    CUdeviceptr ptr = 0;
    CUresult r = drv.reserve(&ptr, (size_t)size, RESERVE_ALIGNMENT, 0, 0);
    if (r != CUDA_SUCCESS) return driver_fail("cuMemAddressReserve", device, r);
    *out = (uintptr_t)ptr;
    return VRAM_OK;
}

/* The driver maps only whole multiples of its granularity; asked once per ctx, as it is fixed
 * per device. */
static vram_status_t check_pages(int device, size_t *granularity, uint64_t size, uint64_t page) {
    if (*granularity == 0) {
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = on_device(device)};
        size_t g = 0;
        CUresult r = drv.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (r != CUDA_SUCCESS) return driver_fail("cuMemGetAllocationGranularity", device, r);
        *granularity = g ? g : 1;
    }
    if (page == 0 || page % *granularity != 0 || size % page != 0)
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "cuda:%d maps memory in pages of a multiple of %zu bytes: cannot map %llu bytes in "
                          "pages of %llu", device, *granularity, (unsigned long long)size,
                          (unsigned long long)page);
    return VRAM_OK;
}

/* Each page is its own allocation and its own mapping, so any page can later be unmapped
 * alone. The handle is released at once: the mapping keeps the memory until it is unmapped,
 * so no handle table is needed (and after a failed map the release frees the memory). */
static CUresult map_page(int device, CUdeviceptr at, size_t page, const char **call) {
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = on_device(device)};
    CUmemGenericAllocationHandle handle;
    *call = "cuMemCreate";
    CUresult r = drv.create(&handle, page, &prop, 0);
    if (r != CUDA_SUCCESS) return r;
    *call = "cuMemMap";
    r = drv.map(at, page, 0, handle, 0);
    CUresult released = drv.release(handle);
    if (r == CUDA_SUCCESS && released != CUDA_SUCCESS) {
        (void)drv.unmap(at, page); /* the caller counts this page as not mapped */
        *call = "cuMemRelease";
        r = released;
    }
    return r;
}

/* Page by page: the driver unmaps only whole mappings, and each page was mapped on its own.
 * Stops at the first failure, leaving the pages before it unmapped. */
/* Unmap page by page; *done (may be NULL) receives the bytes unmapped before a failure. */
static CUresult unmap_pages(uintptr_t addr, uint64_t size, uint64_t page, uint64_t *done) {
    uint64_t off = 0;
    CUresult r = CUDA_SUCCESS;
    for (; off < size; off += page)
        if ((r = drv.unmap((CUdeviceptr)(addr + off), (size_t)page)) != CUDA_SUCCESS) break;
    if (done) *done = off;
    return r;
}

vram_status_t vram__cuda_vmm_map(int device, size_t *granularity, uintptr_t addr, uint64_t size, uint64_t page) {
    vram_status_t status = check_pages(device, granularity, size, page);
    if (status != VRAM_OK || size == 0) return status;
    const char *call = NULL;
    CUresult r = CUDA_SUCCESS;
    uint64_t mapped = 0;
    for (; mapped < size; mapped += page)
        if ((r = map_page(device, (CUdeviceptr)(addr + mapped), (size_t)page, &call)) != CUDA_SUCCESS) break;
    if (r == CUDA_SUCCESS) {
        /* New mappings start inaccessible; one call covers all of them. */
        CUmemAccessDesc access = {.location = on_device(device), .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        call = "cuMemSetAccess";
        r = drv.set_access((CUdeviceptr)addr, (size_t)size, &access, 1);
    }
    if (r == CUDA_SUCCESS) return VRAM_OK;
    /* All or nothing. Should this rollback fail, the pages stay mapped but unused: the pool
     * thinks them unmapped and maps them again later, which then fails as a backend error. */
    (void)unmap_pages(addr, mapped, page, NULL);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return VRAM_ERR_OOM; /* the pool writes the OOM message */
    return driver_fail(call, device, r);
}

vram_status_t vram__cuda_vmm_unmap(int device, uintptr_t addr, uint64_t size, uint64_t page) {
    if (page == 0 || size % page != 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "cuda:%d cannot unmap %llu bytes in pages of %llu", device,
                          (unsigned long long)size, (unsigned long long)page);
    uint64_t done = 0;
    CUresult r = unmap_pages(addr, size, page, &done);
    if (r == CUDA_SUCCESS) return VRAM_OK;
    /* All or nothing, as the pool assumes: map the pages already unmapped again (new memory;
     * they were free), so the pool's "still mapped" stays true. Only a broken context gets
     * here, and then this may fail too. */
    vram_status_t status = driver_fail("cuMemUnmap", device, r);
    const char *call = NULL;
    for (uint64_t off = 0; off < done; off += page)
        if (map_page(device, (CUdeviceptr)(addr + off), (size_t)page, &call) != CUDA_SUCCESS) return status;
    if (done) {
        CUmemAccessDesc access = {.location = on_device(device), .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        (void)drv.set_access((CUdeviceptr)addr, (size_t)done, &access, 1);
    }
    return status;
}

void vram__cuda_vmm_release(uintptr_t addr, uint64_t size) {
    (void)drv.address_free((CUdeviceptr)addr, (size_t)size); /* the pool cannot act on a failure */
}

#endif /* VRAMKIT_WITH_CUDA */
