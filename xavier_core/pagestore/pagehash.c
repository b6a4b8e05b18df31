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
    const uint64_t *ranges;
    size_t words; /* per segment: 2 (address, length) or, for a read, 3 (remote, local, length) */
    size_t pages;
    size_t segments;
    unsigned char *out;
    pid_t pid; /* read_part: the process the pages are read out of */
    int hash; /* read_part: 0 reads the pages alone (no checksums: `out` is NULL) */
    size_t group; /* read_part: pages a thread takes at a time (`read_group`) */
    size_t next; /* the next page not yet taken by a thread (atomic) */
    int stop; /* set by the first thread that fails, seen by the others at their next page (atomic) */
} job;

typedef struct {
    job *job;
    void *state;
    int rc;
} part;

/* The next page for a thread of `j` to do, or `j->pages` when none is left or a thread failed. Pages are
   handed out one at a time, so a thread the kernel runs late (cores shared with an engine's busy threads)
   takes fewer of them instead of holding the whole call back. */
static size_t take_pages(job *j, size_t n) {
    if (__atomic_load_n(&j->stop, __ATOMIC_RELAXED)) {
        return j->pages;
    }
    size_t page = __atomic_fetch_add(&j->next, n, __ATOMIC_RELAXED);
    return page < j->pages ? page : j->pages;
}

static size_t take_page(job *j) { return take_pages(j, 1); }

static void fail(part *p, int rc) {
    p->rc = rc;
    __atomic_store_n(&p->job->stop, 1, __ATOMIC_RELAXED);
}

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

static void put_digest(const part *p, size_t page) {
    hash128 h = p->job->digest(p->state);
    put_be64(p->job->out + 16 * page, h.high64);
    put_be64(p->job->out + 16 * page + 8, h.low64);
}

static void *hash_part(void *arg) {
    part *p = (part *)arg;
    job *j = p->job;
    for (size_t page = take_page(j); page < j->pages; page = take_page(j)) {
        int rc = j->reset(p->state);
        const uint64_t *r = j->ranges + j->words * j->segments * page;
        for (size_t s = 0; rc == 0 && s < j->segments; s++) {
            rc = j->update(p->state, (const void *)(uintptr_t)r[2 * s], (size_t)r[2 * s + 1]);
        }
        if (rc != 0) {
            fail(p, rc);
            return NULL;
        }
        put_digest(p, page);
    }
    return NULL;
}

#define MAX_SEGMENTS 1024 /* Linux's UIO_MAXIOV: the iovecs of one system call, on each side */
#define GROUP_BYTES (1 << 20) /* a group's pages stay about this size: still in cache when hashed */

/* Pages a reading thread takes at a time: as many as stay within GROUP_BYTES and the iovec limit, and
   few enough that every thread gets about two groups (a late thread then holds the call back by one
   group at most); at least one. */
static size_t read_group(const uint64_t *ranges, size_t pages, size_t segments, size_t threads) {
    size_t page_bytes = 0;
    for (size_t s = 0; s < segments; s++) {
        page_bytes += (size_t)ranges[3 * s + 2];
    }
    size_t group = page_bytes ? GROUP_BYTES / page_bytes : 1;
    if (segments && group > MAX_SEGMENTS / segments) {
        group = MAX_SEGMENTS / segments;
    }
    if (group > pages / (2 * threads)) {
        group = pages / (2 * threads);
    }
    return group ? group : 1;
}

/* Reads pages out of process `pid` into this process's memory (`ranges` holds remote address, local
   address, length words per segment), then hashes each while it is still in this core's cache: one pass
   over memory where a read and a later check take two. A thread takes a group of pages at a time
   (`read_group`) and reads the group in one process_vm_readv, segment by segment:
   a segment's ranges of consecutive pages that lie one after another in the remote process (consecutive
   slots of a store chunk) go as one remote iovec, so a page of many small segments costs the kernel one
   remote range per segment and group, not per page. A failed or short read sets `rc` to -errno (-EIO:
   short) and stops the other threads at their next group. */
static void *read_part(void *arg) {
    part *p = (part *)arg;
    job *j = p->job;
    struct iovec local[MAX_SEGMENTS], remote[MAX_SEGMENTS];
    size_t group = j->group;
    for (size_t at = take_pages(j, group); at < j->pages; at = take_pages(j, group)) {
        size_t end = at + group < j->pages ? at + group : j->pages;
        size_t nl = 0, nr = 0;
        ssize_t want = 0;
        for (size_t s = 0; s < j->segments; s++) {
            for (size_t page = at; page < end; page++) {
                const uint64_t *r = j->ranges + 3 * (j->segments * page + s);
                void *from = (void *)(uintptr_t)r[0];
                size_t len = (size_t)r[2];
                local[nl++] = (struct iovec){(void *)(uintptr_t)r[1], len};
                want += (ssize_t)len;
                if (nr && (char *)remote[nr - 1].iov_base + remote[nr - 1].iov_len == (char *)from) {
                    remote[nr - 1].iov_len += len;
                } else {
                    remote[nr++] = (struct iovec){from, len};
                }
            }
        }
        ssize_t got = process_vm_readv(j->pid, local, nl, remote, nr, 0);
        if (got != want) {
            fail(p, got < 0 ? -errno : -EIO);
            return NULL;
        }
        for (size_t page = at; j->hash && page < end; page++) {
            const uint64_t *r = j->ranges + 3 * j->segments * page;
            int rc = j->reset(p->state);
            for (size_t s = 0; rc == 0 && s < j->segments; s++) {
                rc = j->update(p->state, (const void *)(uintptr_t)r[3 * s + 1], (size_t)r[3 * s + 2]);
            }
            if (rc != 0) {
                fail(p, rc);
                return NULL;
            }
            put_digest(p, page);
        }
    }
    return NULL;
}

/* The loop's helper threads, started as calls first need them and kept for the process's life, each
   asleep on `pool.wake` between calls: starting and joining a call's threads anew cost it 0.1-1 ms
   (16 threads: about 1.2 ms on two cores), where a call of 0.5B-shaped pages takes 2 ms in all. A call
   hangs its job on the pool's list, wanting some helpers; an idle helper takes one place of the first
   job still wanting one, with the next part (its XXH3 state) of that job. The calling thread works too
   and, once no page is left to take, takes its job off the list and waits for the helpers that joined
   it, so no helper touches a job (on the caller's stack) after its call returned. Several calls at once
   (threads of one process) share the helpers: a job that gets fewer is done by fewer, its caller
   always among them. */
typedef struct task {
    job *job;
    part *parts;
    void *(*work)(void *);
    size_t wanted; /* helpers it still takes */
    size_t next_part; /* the part the next helper takes (0 is the caller's) */
    size_t active; /* helpers working on it now */
    pthread_cond_t done; /* signalled as its last active helper leaves */
    struct task *next;
} task;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    task *jobs; /* jobs still wanting helpers, oldest first */
    size_t threads; /* helpers started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0};

static void unlink_task(task *t) {
    for (task **at = &pool.jobs; *at; at = &(*at)->next) {
        if (*at == t) {
            *at = t->next;
            return;
        }
    }
}

static void *helper(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.jobs == NULL) {
            pthread_cond_wait(&pool.wake, &pool.lock);
        }
        task *t = pool.jobs;
        part *p = &t->parts[t->next_part++];
        if (--t->wanted == 0) {
            pool.jobs = t->next;
        }
        t->active++;
        pthread_mutex_unlock(&pool.lock);
        t->work(p);
        pthread_mutex_lock(&pool.lock);
        if (--t->active == 0) {
            pthread_cond_signal(&t->done);
        }
    }
    return NULL;
}

/* In a child forked while a call ran, no helper exists and the lock may be held: start over there. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.jobs = NULL;
    pool.threads = 0;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Under the pool's lock: helpers started until `want` exist (fewer where the system refuses more). */
static void pool_grow(size_t want) {
    pthread_attr_t attr;
    if (pool.threads >= want || pthread_attr_init(&attr) != 0) {
        return;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.threads < want) {
        pthread_t id;
        if (pthread_create(&id, &attr, helper, NULL) != 0) {
            break;
        }
        pool.threads++;
    }
    pthread_attr_destroy(&attr);
}

static int run_parts(void *(*work)(void *), pid_t pid, void *reset, void *update, void *digest,
                     void **states, size_t threads, const uint64_t *ranges, size_t words, size_t pages,
                     size_t segments, unsigned char *out) {
    job j = {(reset_fn)reset, (update_fn)update, (digest_fn)digest, ranges, words, pages, segments, out, pid,
             out != NULL, 1, 0, 0};
    part parts[MAX_THREADS];
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    if (threads > pages) {
        threads = pages;
    }
    if (threads == 0) {
        return 0;
    }
    if (words == 3) {
        j.group = read_group(ranges, pages, segments, threads);
    }
    for (size_t t = 0; t < threads; t++) {
        parts[t] = (part){&j, states[t], 0};
    }
    task t = {&j, parts, work, threads - 1, 1, 0, PTHREAD_COND_INITIALIZER, NULL};
    if (t.wanted) {
        pthread_once(&pool_once, pool_init);
        pthread_mutex_lock(&pool.lock);
        pool_grow(t.wanted);
        task **tail = &pool.jobs;
        while (*tail) {
            tail = &(*tail)->next;
        }
        *tail = &t;
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work(&parts[0]);
    if (threads > 1) {
        pthread_mutex_lock(&pool.lock);
        if (t.wanted) {
            unlink_task(&t);
            t.wanted = 0;
        }
        while (t.active) {
            pthread_cond_wait(&t.done, &pool.lock);
        }
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_cond_destroy(&t.done);
    int rc = 0;
    for (size_t i = 0; i < t.next_part && rc == 0; i++) {
        rc = parts[i].rc;
    }
    return rc;
}

/* For each of `pages` pages, XXH3-128 over its `segments` ranges in order (`ranges` holds pages x segments
   x (address, length) words), written canonical (high 64 bits, then low, big-endian) at out + 16 * page.
   Up to `threads` (at most 64) threads, one XXH3 state each (`states`), take the pages one at a time:
   the calling thread is one of them and, where no other can be started, does them all. Returns 0, or the
   first nonzero status of the library's reset or update. */
int xavier_hash_pages(void *reset, void *update, void *digest, void **states, size_t threads,
                      const uint64_t *ranges, size_t pages, size_t segments, unsigned char *out) {
    return run_parts(hash_part, 0, reset, update, digest, states, threads, ranges, 2, pages, segments, out);
}

/* As `xavier_hash_pages`, each page first read out of process `pid`: `ranges` holds pages x segments x
   (remote address, local address, length) words, and a page's checksum is of the bytes that landed
   locally; with `out` NULL the pages are read alone, unhashed (`reset`, `update`, `digest` and the
   states unused). At most 1,024 segments a page. Returns 0; -errno of the first read that failed (-EIO: short,
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
