/* dlpack.h — the DLPack ABI (v1.0) as consumers expect it: plain C structs whose layout is
 * fixed by the DLPack specification. Written out here so the build needs no extra header. */
#ifndef VRAM_PYTHON_DLPACK_H
#define VRAM_PYTHON_DLPACK_H

#include <stdint.h>

enum { VK_DL_CPU = 1, VK_DL_CUDA = 2 };                       /* DLDeviceType values */
enum { VK_DL_INT = 0, VK_DL_UINT = 1, VK_DL_FLOAT = 2, VK_DL_BFLOAT = 4, VK_DL_COMPLEX = 5, VK_DL_BOOL = 6 };

typedef struct {
    int32_t device_type;
    int32_t device_id;
} vk_dl_device_t;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} vk_dl_dtype_t;

typedef struct {
    void *data;
    vk_dl_device_t device;
    int32_t ndim;
    vk_dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides; /* NULL means compact row-major */
    uint64_t byte_offset;
} vk_dl_tensor_t;

/* The legacy capsule payload, named "dltensor". */
typedef struct vk_dl_managed {
    vk_dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct vk_dl_managed *self);
} vk_dl_managed_t;

typedef struct {
    uint32_t major, minor;
} vk_dl_version_t;

/* The versioned payload (DLPack >= 1.0), named "dltensor_versioned". */
typedef struct vk_dl_managed_versioned {
    vk_dl_version_t version;
    void *manager_ctx;
    void (*deleter)(struct vk_dl_managed_versioned *self);
    uint64_t flags;
    vk_dl_tensor_t dl_tensor;
} vk_dl_managed_versioned_t;

#endif
