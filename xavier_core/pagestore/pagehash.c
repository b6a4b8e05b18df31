/* Page checksums of many pages in one call, made without the GIL (`xavier_core/pagestore/native.py`).

   XXH3-128 itself is the `xxhash` module's: its streaming calls come in as function pointers, so this
   file holds only the loops, and its checksums are `layout.page_checksum`'s by construction. A call made
   through ctypes.CDLL runs with the GIL released, and the threads that share its pages are this file's
   own, so a get waits for the GIL once, not once per page, segment or Python worker thread (each such wait
   lasts up to a switch interval beside a busy Python thread, as SGLang's scheduler is). The same loop can
   read each page out of a same-host store's memory first (`xavier_read_hash_pages`), so the check hashes
   bytes still in cache rather than making a second pass over them. */

#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define MAX_THREADS 64

typedef struct {
    uint64_t low64;
    uint64_t high64;
} hash128;

typedef int (*reset_fn)(void *state);
typedef int (*update_fn)(void *state, const void *input, size_t length);
typedef hash128 (*digest_fn)(const void *state);

typedef struct {
    reset_fn reset;
    update_fn update;
    digest_fn digest;
    void *state;
    const uint64_t *ranges;
    size_t pages;
    size_t segments;
    unsigned char *out;
    int rc;
    pid_t pid; /* read_part: the process the pages are read out of */
    volatile int *stop; /* read_part: set by the first part that fails, seen by the others */
} part;

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

static void put_digest(const part *p, size_t page) {
    hash128 h = p->digest(p->state);
    put_be64(p->out + 16 * page, h.high64);
    put_be64(p->out + 16 * page + 8, h.low64);
}

static void *hash_part(void *arg) {
    part *p = (part *)arg;
    p->rc = 0;
    for (size_t page = 0; page < p->pages; page++) {
        int rc = p->reset(p->state);
        const uint64_t *r = p->ranges + 2 * p->segments * page;
        for (size_t s = 0; rc == 0 && s < p->segments; s++) {
            rc = p->update(p->state, (const void *)(uintptr_t)r[2 * s], (size_t)r[2 * s + 1]);
        }
        if (rc != 0) {
            p->rc = rc;
            return NULL;
        }
        put_digest(p, page);
    }
    return NULL;
}

#define MAX_SEGMENTS 1024 /* Linux's UIO_MAXIOV: one system call reads a page */

/* Reads each page's segments out of process `pid` into this process's memory (one process_vm_readv a
   page: `ranges` holds remote address, local address, length words per segment), then hashes them while
   they are still in this core's cache: one pass over memory where a read and a later check take two.
   A failed or short read sets `rc` to -errno (-EIO: short) and `stop`, which ends the other parts at
   their next page. */
static void *read_part(void *arg) {
    part *p = (part *)arg;
    struct iovec local[MAX_SEGMENTS], remote[MAX_SEGMENTS];
    p->rc = 0;
    for (size_t page = 0; page < p->pages; page++) {
        if (*p->stop) {
            return NULL;
        }
        const uint64_t *r = p->ranges + 3 * p->segments * page;
        ssize_t want = 0;
        for (size_t s = 0; s < p->segments; s++) {
            remote[s] = (struct iovec){(void *)(uintptr_t)r[3 * s], (size_t)r[3 * s + 2]};
            local[s] = (struct iovec){(void *)(uintptr_t)r[3 * s + 1], (size_t)r[3 * s + 2]};
            want += (ssize_t)r[3 * s + 2];
        }
        ssize_t got = process_vm_readv(p->pid, local, p->segments, remote, p->segments, 0);
        if (got != want) {
            p->rc = got < 0 ? -errno : -EIO;
            *p->stop = 1;
            return NULL;
        }
        int rc = p->reset(p->state);
        for (size_t s = 0; rc == 0 && s < p->segments; s++) {
            rc = p->update(p->state, local[s].iov_base, local[s].iov_len);
        }
        if (rc != 0) {
            p->rc = rc;
            *p->stop = 1;
            return NULL;
        }
        put_digest(p, page);
    }
    return NULL;
}

static int run_parts(void *(*work)(void *), pid_t pid, void *reset, void *update, void *digest,
                     void **states, size_t threads, const uint64_t *ranges, size_t words, size_t pages,
                     size_t segments, unsigned char *out) {
    part parts[MAX_THREADS];
    volatile int stop = 0;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (threads > pages) {
        threads = pages;
    }
    if (threads == 0) {
        return 0;
    }
    size_t step = (pages + threads - 1) / threads;
    for (size_t t = 0; t < threads; t++) {
        size_t lo = t * step < pages ? t * step : pages;
        size_t hi = lo + step < pages ? lo + step : pages;
        parts[t] = (part){(reset_fn)reset, (update_fn)update, (digest_fn)digest, states[t],
                          ranges + words * segments * lo, hi - lo, segments, out + 16 * lo, 0, pid, &stop};
        started[t] = 0;
    }
    for (size_t t = 1; t < threads; t++) {
        started[t] = pthread_create(&ids[t], NULL, work, &parts[t]) == 0;
    }
    work(&parts[0]);
    int rc = parts[0].rc;
    for (size_t t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(ids[t], NULL);
        } else {
            work(&parts[t]);
        }
        if (rc == 0) {
            rc = parts[t].rc;
        }
    }
    return rc;
}

/* For each of `pages` pages, XXH3-128 over its `segments` ranges in order (`ranges` holds pages x segments
   x (address, length) words), written canonical (high 64 bits, then low, big-endian) at out + 16 * page.
   The pages are cut into `threads` (at most 64) consecutive parts, one XXH3 state each (`states`), hashed
   at once: the calling thread takes the first part; a part whose thread cannot be started is hashed on the
   calling thread too. Returns 0, or the first nonzero status of the library's reset or update. */
int xavier_hash_pages(void *reset, void *update, void *digest, void **states, size_t threads,
                      const uint64_t *ranges, size_t pages, size_t segments, unsigned char *out) {
    return run_parts(hash_part, 0, reset, update, digest, states, threads, ranges, 2, pages, segments, out);
}

/* As `xavier_hash_pages`, each page first read out of process `pid`: `ranges` holds pages x segments x
   (remote address, local address, length) words, and a page's checksum is of the bytes that landed
   locally. At most 1,024 segments a page. Returns 0; -errno of the first read that failed (-EIO: short,
   -EINVAL: too many segments), after which the local pages hold unspecified bytes; or the library's
   nonzero status. */
int xavier_read_hash_pages(int pid, void *reset, void *update, void *digest, void **states, size_t threads,
                           const uint64_t *ranges, size_t pages, size_t segments, unsigned char *out) {
    if (segments > MAX_SEGMENTS) {
        return -EINVAL;
    }
    return run_parts(read_part, (pid_t)pid, reset, update, digest, states, threads, ranges, 3, pages,
                     segments, out);
}
