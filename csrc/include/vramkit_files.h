/* vramkit_files.h — checks on files that vramkit reads from anyone (snapshot pickles).
 * Part of vramkit's public C API; vramkit.h includes it (and it includes vramkit.h for the
 * status codes and export macros), so either can be included first. */
#ifndef VRAMKIT_FILES_H
#define VRAMKIT_FILES_H

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Files: a pickle that is plain data, checked before any unpickler sees it
 *
 * A memory snapshot (torch.cuda.memory._dump_snapshot, vramkit's dump_snapshot) is a pickle of
 * dicts, lists, tuples, strings, bytes, numbers, None and booleans. Python's unpickler trusts
 * its input in two ways that a file from anyone must not be trusted with:
 *   - code: a class or function reference (GLOBAL, STACK_GLOBAL, INST, EXT*) followed by
 *     REDUCE, BUILD, OBJ or NEWOBJ calls it;
 *   - memory: CPython allocates a bytes object of the length BINBYTES/BINBYTES8/BYTEARRAY8
 *     declare before it reads them (10 bytes can ask for an exabyte), and a memo index
 *     (PUT, BINPUT, LONG_BINPUT) grows the memo table to twice that index and zero-fills it
 *     (a 4-byte index of 2**31 writes 32 GiB).
 * ====================================================================================== */

/* VRAM_OK when `data` (len bytes) is a pickle of plain data, up to its STOP opcode: every opcode
 * known, every length within the data, memo indices dense (a PUT names at most one past the
 * entries stored so far, a GET an entry stored), protocol at most 5, and no opcode that names,
 * calls or builds an object (GLOBAL, STACK_GLOBAL, INST, OBJ, REDUCE, BUILD, NEWOBJ, NEWOBJ_EX,
 * EXT1/2/4) or hands one in from outside (PERSID, BINPERSID, NEXT_BUFFER, READONLY_BUFFER).
 * Otherwise VRAM_ERR_INVALID_ARG with the opcode, its byte offset and what is wrong in
 * vram_last_error(); *names_code (may be NULL) is 1 when the refusal is one of those objects
 * (for a class reference the message names it, e.g. "posix.system"), 0 when the data is
 * malformed. Reads the data once, allocates nothing, keeps no state: any thread, any time. */
VRAM_API VRAM_NODISCARD vram_status_t vram_plain_pickle_check(const void *data, size_t len, int *names_code);

#ifdef __cplusplus
}
#endif

#endif /* VRAMKIT_FILES_H */
