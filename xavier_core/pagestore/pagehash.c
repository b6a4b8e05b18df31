/* Page checksums of many pages in one call, made without the GIL (`xavier_core/pagestore/native.py`).

   XXH3-128 itself is the `xxhash` module's: its streaming calls come in as function pointers, so this
   file holds only the loop, and its checksums are `layout.page_checksum`'s by construction. A call made
   through ctypes.CDLL runs with the GIL released, so a get's pages are hashed with one GIL hand-off per
   thread instead of one per page or segment (each of which waits up to a switch interval beside a busy
   Python thread, as SGLang's scheduler is). */

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t low64;
    uint64_t high64;
} hash128;

typedef int (*reset_fn)(void *state);
typedef int (*update_fn)(void *state, const void *input, size_t length);
typedef hash128 (*digest_fn)(const void *state);

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

/* For each of `pages` pages, XXH3-128 over its `segments` ranges in order (`ranges` holds pages x segments
   x (address, length) words), written canonical (high 64 bits, then low, big-endian) at out + 16 * page.
   Returns 0, or the first nonzero status of the library's reset or update. */
int xavier_hash_pages(void *reset, void *update, void *digest, void *state, const uint64_t *ranges,
                      size_t pages, size_t segments, unsigned char *out) {
    reset_fn do_reset = (reset_fn)reset;
    update_fn do_update = (update_fn)update;
    digest_fn do_digest = (digest_fn)digest;
    for (size_t p = 0; p < pages; p++) {
        int rc = do_reset(state);
        if (rc != 0) {
            return rc;
        }
        const uint64_t *r = ranges + 2 * segments * p;
        for (size_t s = 0; s < segments; s++) {
            rc = do_update(state, (const void *)(uintptr_t)r[2 * s], (size_t)r[2 * s + 1]);
            if (rc != 0) {
                return rc;
            }
        }
        hash128 h = do_digest(state);
        put_be64(out + 16 * p, h.high64);
        put_be64(out + 16 * p + 8, h.low64);
    }
    return 0;
}
