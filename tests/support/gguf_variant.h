/* tests/support/gguf_variant.h — a modified copy of a real GGUF for tests: the sliding window
 * rewritten (so a short prompt runs past it) and, optionally, every matrix decoded to F32 by the
 * quant module's dequantisers (the file's weights without activation quantisation). */
#ifndef KVBT_GGUF_VARIANT_H
#define KVBT_GGUF_VARIANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Writes dst: a copy of src_path with every "<arch>.attention.sliding_window" key set to window
 * (0: unchanged) and, when to_f32, every non-F32 tensor decoded to F32 (general.file_type 0).
 * Returns 0, or -1 with a message in err (cap bytes). */
int kvbt_gguf_variant(const char *src_path, const char *dst, uint32_t window, bool to_f32, char *err, size_t cap);

#endif
