/* tests/quant_dump.c — a small helper for tests/quant_file_check.py, which compares our block
 * decoders and quantisers with the gguf Python package's on real GGUF files. Three modes, raw
 * little-endian data on stdout:
 *   quant_dump FILE TENSOR          the tensor dequantised row by row with kvb_row_to_f32 (f32)
 *   quant_dump --ref FILE TENSOR    the same through the float64 reference model's own decoder
 *                                   (ref_dequant_row), each value rounded to f32
 *   quant_dump --quantize TYPE N    N f32 values read from stdin, quantised with kvb_f32_to_row
 *                                   into N elements of TYPE (e.g. q5_0)
 *   quant_dump --decode TYPE N      N elements of TYPE read from stdin, decoded with
 *                                   kvb_row_to_f32 into N f32
 * Prints the tensor's type and shape on stderr. Exit status 0 on success, 1 on any error (with a
 * message on stderr), 2 for bad usage. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_gguf.h"
#include "kvb_quant.h"
#include "ref_model.h"

static int usage(void) {
    fprintf(stderr, "usage: quant_dump [--ref] FILE TENSOR | quant_dump --quantize|--decode TYPE N\n");
    return 2;
}

static int write_all(const void *p, size_t n) {
    if (fwrite(p, 1, n, stdout) != n) {
        fprintf(stderr, "quant_dump: write failed\n");
        return 1;
    }
    return 0;
}

/* --quantize (decode == 0): f32 [n] on stdin -> TYPE row on stdout; --decode: the reverse. */
static int convert_stdin(const char *type_name, const char *count, int decode) {
    kvb_type type;
    kvb_err err = {0};
    if (kvb_type_from_name(type_name, &type, &err) != KVB_OK) {
        fprintf(stderr, "quant_dump: %s\n", err.msg);
        return 1;
    }
    const int64_t n = strtoll(count, NULL, 10);
    const size_t bytes = kvb_row_bytes(type, n);
    const kvb_type_info *ti = kvb_type_get(type);
    if (n <= 0 || bytes == 0 || !ti->supported) {
        fprintf(stderr, "quant_dump: cannot convert %" PRId64 " elements of %s\n", n, kvb_type_name(type));
        return 1;
    }
    const size_t fbytes = (size_t)n * sizeof(float);
    float *x = malloc(fbytes);       /* [n] */
    uint8_t *row = malloc(bytes);    /* [bytes] */
    int rc = 1;
    if (!x || !row) {
        fprintf(stderr, "quant_dump: out of memory\n");
    } else if (fread(decode ? (void *)row : (void *)x, 1, decode ? bytes : fbytes, stdin) !=
               (decode ? bytes : fbytes)) {
        fprintf(stderr, "quant_dump: expected %zu bytes on stdin\n", decode ? bytes : fbytes);
    } else if (decode) {
        kvb_row_to_f32(type, row, x, n);
        rc = write_all(x, fbytes);
    } else {
        kvb_f32_to_row(type, x, row, n);
        rc = write_all(row, bytes);
    }
    free(x);
    free(row);
    return rc;
}

static int dump_tensor(const char *path, const char *name, int use_ref) {
    kvb_gguf *g = NULL;
    kvb_err err = {0};
    if (kvb_gguf_open(path, &g, &err) != KVB_OK) {
        fprintf(stderr, "quant_dump: %s\n", err.msg);
        return 1;
    }
    int rc = 1;
    float *row = NULL;   /* [cols] */
    double *drow = NULL; /* [cols] */
    const kvb_gguf_tensor *t = kvb_gguf_find_tensor(g, name);
    if (!t) {
        fprintf(stderr, "quant_dump: %s has no tensor '%s'\n", path, name);
        goto done;
    }
    const int64_t cols = (int64_t)t->ne[0];
    const uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3];
    const size_t rb = kvb_row_bytes(t->type, cols);
    const kvb_type_info *ti = kvb_type_get(t->type);
    fprintf(stderr, "%s: %s [%" PRId64 " x %" PRIu64 "]\n", name, kvb_type_name(t->type), cols, rows);
    if (!ti || !ti->supported || rb == 0) {
        fprintf(stderr, "quant_dump: tensor '%s' has type %s, which kvb_row_to_f32 does not decode\n", name,
                kvb_type_name(t->type));
        goto done;
    }
    row = malloc((size_t)cols * sizeof *row);
    drow = malloc((size_t)cols * sizeof *drow);
    if (!row || !drow) {
        fprintf(stderr, "quant_dump: out of memory\n");
        goto done;
    }
    for (uint64_t r = 0; r < rows; r++) {
        const uint8_t *src = (const uint8_t *)t->data + r * rb;
        if (use_ref) {
            if (ref_dequant_row(t->type, src, drow, cols) != 0) {
                fprintf(stderr, "quant_dump: the reference decoder rejects type %s\n", kvb_type_name(t->type));
                goto done;
            }
            for (int64_t i = 0; i < cols; i++) row[i] = (float)drow[i];
        } else {
            kvb_row_to_f32(t->type, src, row, cols);
        }
        if (write_all(row, (size_t)cols * sizeof *row)) goto done;
    }
    rc = 0;
done:
    free(row);
    free(drow);
    kvb_gguf_close(g);
    return rc;
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--quantize") == 0) return convert_stdin(argv[2], argv[3], 0);
    if (argc == 4 && strcmp(argv[1], "--decode") == 0) return convert_stdin(argv[2], argv[3], 1);
    if (argc == 4 && strcmp(argv[1], "--ref") == 0) return dump_tensor(argv[2], argv[3], 1);
    if (argc == 3 && argv[1][0] != '-') return dump_tensor(argv[1], argv[2], 0);
    return usage();
}
