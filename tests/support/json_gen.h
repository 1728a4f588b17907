/* support/json_gen.h — random JSON texts for the grammar tests: valid values with random blanks
 * between tokens, strings with escapes and multi-byte characters, numbers of every form, written
 * into a caller's buffer (large enough: 64 KiB holds any value these make). One xorshift stream,
 * seeded per test file, so each run makes the same texts. */
#ifndef KVBT_JSON_GEN_H
#define KVBT_JSON_GEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

void kvbt_rnd_seed(uint64_t seed);
uint32_t kvbt_rnd(uint32_t n); /* 0 .. n-1 */

void kvbt_put(char *buf, size_t *n, const char *s); /* appends s at buf + *n */
void kvbt_blanks(char *buf, size_t *n);              /* nothing, or a short run of JSON whitespace */
void kvbt_gen_json_string(char *buf, size_t *n);
void kvbt_gen_json_number(char *buf, size_t *n, bool integer);
/* Any value (objects and arrays only while depth < max_depth), and an object of such values. */
void kvbt_gen_json_value(char *buf, size_t *n, int depth, int max_depth);
void kvbt_gen_json_object(char *buf, size_t *n, int depth, int max_depth);

#endif
