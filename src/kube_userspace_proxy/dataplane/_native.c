/*
 * The native TCP data plane's mechanism: accept, dial, copy or splice, half-close, reset.
 *
 * One `Core` per event loop owns an epoll set and exposes its descriptor; the loop watches it
 * (`loop.add_reader`) and calls `run()`, which handles every ready event here and hands back,
 * in one list, what needs a decision or a count in Python: new connections (Python picks the
 * endpoint and calls `dial`), each dial's outcome (Python counts it, reports it to the
 * balancer and dials the next endpoint or gives up), and ended connections with their bytes.
 * Nothing here chooses an endpoint, retries on its own, or parses a byte of what it moves.
 *
 * One exception is measured, bounded and tested against the Python: a `Table` is a copy,
 * pushed by balancer.py, of a pool in plain round robin (no affinity, no penalty, no PROXY
 * header, no transparent source). While a listener's table is enabled, an accepted connection
 * is dialed here to the table's next entry, and Python hears of it once, with the dial's
 * outcome (EV_FAST): the accept, the pick and the dial cost no Python call. The table's cursor
 * is the pool's while it is enabled; the pool takes it back before it picks itself.
 *
 * The system-call diet follows HAProxy: accept4(SOCK_NONBLOCK), socket(SOCK_NONBLOCK), each
 * descriptor registered once (edge-triggered, read and write interest together), an accepted
 * client registered only once its endpoint answered and after a first read (a new descriptor
 * is treated as ready), a short read taken as "drained", pooled copy buffers and pipes, dial
 * deadlines and delayed keepalive options on one timerfd that is re-armed only when an earlier
 * deadline comes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#ifndef IP_TRANSPARENT
#define IP_TRANSPARENT 19
#endif
#ifndef IPV6_TRANSPARENT
#define IPV6_TRANSPARENT 75
#endif
#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

/* What run() hands back (the first item of each tuple). */
enum { EV_ACCEPTED = 1, EV_DIALED = 2, EV_CLOSED = 3, EV_ACCEPT_ERROR = 4, EV_FAST = 5 };
/* How a dial ended: model.DialOutcome's values, then this process's own failure. */
enum { DIAL_CONNECTED = 0, DIAL_REFUSED = 1, DIAL_TIMED_OUT = 2, DIAL_UNREACHABLE = 3,
       DIAL_NO_DESCRIPTORS = 4 };
/* How a connection ended (EV_CLOSED): both sides finished, or a reset, or closed by Python. */
enum { END_NORMAL = 0, END_RESET = 1, END_CLOSED = 2 };

enum { C_FREE = 0, C_WAITING, C_DIALING, C_OPEN };

/* epoll data: a slot index << 2 | what it is. */
enum { TAG_CLIENT = 0, TAG_BACKEND = 1, TAG_LISTENER = 2, TAG_SPECIAL = 3 };
enum { SPECIAL_TIMER = 0, SPECIAL_WAKE = 1, SPECIAL_FDS = 2 /* + a descriptor Python watches */ };

#define ACCEPT_BURST 64
#define PUMP_TURNS 8       /* reads or splices per direction per wakeup: then others' turn */
#define SPLICE_AFTER 4     /* consecutive full reads before a direction switches to splice */
#define SLAB 1024          /* connections per allocation (their addresses never move) */
#define KEEPALIVE_DELAY_NS 1000000000LL
/* Method tables take one pointer type; the cast through void(*)(void) says it is meant. */
#define METH(f) ((PyCFunction)(void (*)(void))(f))

typedef struct buf {
    struct buf *next;
    char data[];
} buf;

typedef struct pipe_ {
    struct pipe_ *next;
    int r, w;
    size_t cap;
} pipe_;

/* One direction of a connection: src -> dst. */
typedef struct {
    buf *b;            /* copy: bytes read and not yet written (off..len) */
    pipe_ *p;          /* splice: the pipe, and how much it holds */
    uint32_t off, len;
    size_t in_pipe;
    uint64_t bytes;    /* moved since the last report */
    uint8_t full_reads;
    uint8_t eof;       /* src said EOF (or it was shut down) */
    uint8_t done;      /* EOF passed on to dst */
    uint8_t spliced;   /* switched to splice at some point */
    uint8_t piped;     /* a splice moved bytes (so a refusal now is an error, not "unsupported") */
} dir_t;

typedef struct conn {
    int cfd, bfd;
    uint32_t gen;
    uint32_t idx;      /* its slot */
    uint8_t state;
    uint8_t c_rd, c_wr, b_rd, b_wr;
    uint8_t splice_ok, queued, ka_listed;
    uint8_t fast;      /* dialed from a table: its outcome goes to Python as EV_FAST */
    int family;
    int ka_idle, ka_intvl, ka_user;
    PyObject *listener;
    PyObject *data;    /* what Python gave the dial (a table entry's, for a fast one) */
    PyObject *entry;   /* a fast dial's table entry (its index and data), until EV_FAST */
    union {
        struct sockaddr sa;
        struct sockaddr_in v4;
        struct sockaddr_in6 v6;
    } peer;            /* a fast dial's client address (Python asks for it to retry) */
    dir_t in, out;     /* in: client -> backend; out: backend -> client */
    int64_t deadline;
    struct conn *tprev, *tnext;  /* dial deadlines, sorted */
    int64_t ka_at;
    struct conn *kprev, *knext;  /* keepalive waiting, in dial order */
    struct conn *qnext;          /* more to do (a pump stopped at its turn limit) */
    struct conn *free_next;
} conn;

/* A table: a copy of a round-robin pool's endpoints and cursor (see the header). */
typedef struct {
    struct sockaddr_storage addr;
    socklen_t len;
    PyObject *entry;   /* (index, data): handed back with EV_FAST */
} tentry;

typedef struct {
    PyObject_HEAD
    tentry *entries;
    Py_ssize_t count;
    Py_ssize_t cursor;
    int timeout_ms;
    uint8_t enabled;
    uint64_t picks;    /* picks made here (fast dials and pick()) */
} Table;

typedef struct {
    int fd;
    PyObject *obj;
    PyObject *table;   /* a Table, or NULL */
    int ka_idle, ka_intvl, ka_user;
    uint8_t splice_ok, used;
} lslot;

typedef struct {
    PyObject_HEAD
    int epfd, tfd, efd;
    uint8_t ready;            /* initialized and not closed */
    int64_t armed;            /* the timerfd's deadline; 0: not armed */
    uint8_t woken;
    conn **slabs;
    size_t nslabs;
    conn *free_conns;
    size_t live;
    lslot *ls;
    size_t nls, capls;
    buf *free_bufs;
    size_t nfree_bufs, bufs_out, keep_bufs, bufsize;
    pipe_ *free_pipes;
    size_t nfree_pipes, pipes_out, keep_pipes, pipe_size;
    conn *thead, *ttail;
    conn *khead, *ktail;
    conn *qhead, *qtail;
    int max_events;
    struct epoll_event *events;
    PyObject *out;            /* the batch run() is building */
    uint64_t splice_unsupported, spliced, resets_sent;
    uint8_t splice_global;
} Core;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- connection slots -------------------------------------------------------------------- */

static conn *conn_at(Core *self, size_t index) {
    size_t s = index / SLAB;
    if (s >= self->nslabs) return NULL;
    return &self->slabs[s][index % SLAB];
}

static size_t conn_index(Core *self, conn *c) {
    (void)self;
    return c->idx;
}

static conn *conn_new(Core *self, size_t *index_out) {
    if (!self->free_conns) {
        conn **slabs = PyMem_Realloc(self->slabs, (self->nslabs + 1) * sizeof(conn *));
        if (!slabs) return NULL;
        self->slabs = slabs;
        conn *slab = PyMem_Calloc(SLAB, sizeof(conn));
        if (!slab) return NULL;
        self->slabs[self->nslabs++] = slab;
        for (size_t i = SLAB; i-- > 0;) {
            slab[i].idx = (uint32_t)((self->nslabs - 1) * SLAB + i);
            slab[i].free_next = self->free_conns;
            slab[i].cfd = slab[i].bfd = -1;
            self->free_conns = &slab[i];
        }
    }
    conn *c = self->free_conns;
    self->free_conns = c->free_next;
    uint32_t gen = c->gen + 1, idx = c->idx;
    memset(c, 0, sizeof(*c));
    c->gen = gen;
    c->idx = idx;
    c->cfd = c->bfd = -1;
    self->live++;
    *index_out = conn_index(self, c);
    return c;
}

static PyObject *conn_id(Core *self, conn *c) {
    return PyLong_FromUnsignedLongLong(((unsigned long long)c->gen << 32) |
                                       (unsigned long long)conn_index(self, c));
}

static conn *conn_of(Core *self, PyObject *id) {
    unsigned long long v = PyLong_AsUnsignedLongLong(id);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    conn *c = conn_at(self, (size_t)(v & 0xffffffffULL));
    if (!c || c->state == C_FREE || c->gen != (uint32_t)(v >> 32)) {
        PyErr_SetString(PyExc_KeyError, "no such connection");
        return NULL;
    }
    return c;
}

/* ---- pools ------------------------------------------------------------------------------- */

static buf *buf_get(Core *self) {
    buf *b = self->free_bufs;
    if (b) {
        self->free_bufs = b->next;
        self->nfree_bufs--;
    } else {
        b = PyMem_Malloc(sizeof(buf) + self->bufsize);
        if (!b) return NULL;
    }
    self->bufs_out++;
    return b;
}

static void buf_put(Core *self, buf *b) {
    self->bufs_out--;
    if (self->nfree_bufs < self->keep_bufs) {
        b->next = self->free_bufs;
        self->free_bufs = b;
        self->nfree_bufs++;
    } else {
        PyMem_Free(b);
    }
}

static pipe_ *pipe_get(Core *self) {
    pipe_ *p = self->free_pipes;
    if (p) {
        self->free_pipes = p->next;
        self->nfree_pipes--;
        self->pipes_out++;
        return p;
    }
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0) return NULL;
    p = PyMem_Malloc(sizeof(*p));
    if (!p) {
        close(fds[0]);
        close(fds[1]);
        return NULL;
    }
    p->r = fds[0];
    p->w = fds[1];
    int cap = fcntl(fds[1], F_SETPIPE_SZ, (int)self->pipe_size);
    if (cap < 0) cap = fcntl(fds[1], F_GETPIPE_SZ);
    p->cap = cap > 0 ? (size_t)cap : 65536;
    self->pipes_out++;
    return p;
}

static void pipe_close(pipe_ *p) {
    close(p->r);
    close(p->w);
    PyMem_Free(p);
}

/* Back to the pool only when empty: a pipe that still holds bytes is closed. */
static void pipe_put(Core *self, pipe_ *p, size_t in_pipe) {
    self->pipes_out--;
    if (in_pipe == 0 && self->nfree_pipes < self->keep_pipes) {
        p->next = self->free_pipes;
        self->free_pipes = p;
        self->nfree_pipes++;
    } else {
        pipe_close(p);
    }
}

static void dir_release(Core *self, dir_t *d) {
    if (d->b) {
        buf_put(self, d->b);
        d->b = NULL;
    }
    if (d->p) {
        pipe_put(self, d->p, d->in_pipe);
        d->p = NULL;
        d->in_pipe = 0;
    }
    d->off = d->len = 0;
}

/* ---- timers: dial deadlines (sorted) and keepalive (in order) on one timerfd ------------- */

static void timer_arm(Core *self) {
    int64_t next = 0;
    if (self->thead) next = self->thead->deadline;
    if (self->khead && (!next || self->khead->ka_at < next)) next = self->khead->ka_at;
    if (!next) return;  /* an armed timer with nothing due just fires once, harmlessly */
    if (self->armed && self->armed <= next) return;
    struct itimerspec its;
    memset(&its, 0, sizeof(its));
    its.it_value.tv_sec = next / 1000000000LL;
    its.it_value.tv_nsec = next % 1000000000LL;
    if (timerfd_settime(self->tfd, TFD_TIMER_ABSTIME, &its, NULL) == 0) self->armed = next;
}

static void deadline_add(Core *self, conn *c, int64_t deadline) {
    c->deadline = deadline;
    conn *after = self->ttail;
    while (after && after->deadline > deadline) after = after->tprev;
    c->tprev = after;
    c->tnext = after ? after->tnext : self->thead;
    if (c->tnext) c->tnext->tprev = c; else self->ttail = c;
    if (after) after->tnext = c; else self->thead = c;
    if (self->thead == c) timer_arm(self);
}

static void deadline_drop(Core *self, conn *c) {
    if (!c->deadline) return;
    if (c->tprev) c->tprev->tnext = c->tnext; else self->thead = c->tnext;
    if (c->tnext) c->tnext->tprev = c->tprev; else self->ttail = c->tprev;
    c->tprev = c->tnext = NULL;
    c->deadline = 0;
}

static void ka_add(Core *self, conn *c, int64_t now) {
    if (c->ka_idle <= 0 || c->ka_listed) return;
    c->ka_listed = 1;
    c->ka_at = now + KEEPALIVE_DELAY_NS;
    c->kprev = self->ktail;
    c->knext = NULL;
    if (self->ktail) self->ktail->knext = c; else self->khead = c;
    self->ktail = c;
    if (self->khead == c) timer_arm(self);
}

static void ka_drop(Core *self, conn *c) {
    if (!c->ka_listed) return;
    if (c->kprev) c->kprev->knext = c->knext; else self->khead = c->knext;
    if (c->knext) c->knext->kprev = c->kprev; else self->ktail = c->kprev;
    c->kprev = c->knext = NULL;
    c->ka_listed = 0;
}

static void set_keepalive(int fd, conn *c) {
    int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &c->ka_idle, sizeof(c->ka_idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &c->ka_intvl, sizeof(c->ka_intvl));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &c->ka_user, sizeof(c->ka_user));
}

/* ---- events for Python ------------------------------------------------------------------- */

static int emit(Core *self, PyObject *item) {
    if (!item) return -1;
    int r = PyList_Append(self->out, item);
    Py_DECREF(item);
    return r;
}

/* A tuple of `n` new references (stolen, released on a failure; one may be NULL: a failed
 * allocation before the call). Cheaper than Py_BuildValue's format, once per connection. */
static PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
    PyObject *t = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!items[i]) goto fail;
    t = PyTuple_New(n);
    if (!t) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    return t;
fail:
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(items[i]);
    return NULL;
}

/* (EV_DIALED, data, conn id, outcome, errno): `id` stolen. */
static int emit_dialed(Core *self, conn *c, PyObject *id, int outcome, int err) {
    PyObject *items[] = {PyLong_FromLong(EV_DIALED), Py_NewRef(c->data ? c->data : Py_None),
                         id, PyLong_FromLong(outcome), PyLong_FromLong(err)};
    return emit(self, tuple_of(5, items));
}

/* (EV_FAST, listener, conn id, (index, data), outcome, errno): a table's dial ended. From now
 * on the connection is Python's, as if it had dialed: its events carry the entry's data. */
static int emit_fast(Core *self, conn *c, int outcome, int err) {
    PyObject *entry = c->entry;
    c->entry = NULL;
    c->fast = 0;
    Py_XSETREF(c->data, Py_NewRef(PyTuple_GET_ITEM(entry, 1)));
    PyObject *items[] = {PyLong_FromLong(EV_FAST), Py_NewRef(c->listener), conn_id(self, c),
                         entry, PyLong_FromLong(outcome), PyLong_FromLong(err)};
    return emit(self, tuple_of(6, items));
}

static void queue(Core *self, conn *c) {
    if (c->queued) return;
    c->queued = 1;
    c->qnext = NULL;
    if (self->qtail) self->qtail->qnext = c; else self->qhead = c;
    self->qtail = c;
}

/* ---- ending a connection ----------------------------------------------------------------- */

static void reset_fd(Core *self, int fd) {
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
    self->resets_sent++;
}

static void conn_free(Core *self, conn *c) {
    deadline_drop(self, c);
    ka_drop(self, c);
    dir_release(self, &c->in);
    dir_release(self, &c->out);
    Py_CLEAR(c->listener);
    Py_CLEAR(c->data);
    Py_CLEAR(c->entry);
    c->fast = 0;
    c->state = C_FREE;
    c->cfd = c->bfd = -1;
    if (c->queued) {
        /* Taken off the queue lazily: run() skips free slots. */
    } else {
        c->free_next = self->free_conns;
        self->free_conns = c;
    }
    self->live--;
}

/* End an open connection: both descriptors closed (`how`: reset both, or a plain close) and
 * an EV_CLOSED with the bytes not reported yet. */
static int conn_end(Core *self, conn *c, int how) {
    if (how == END_RESET) {
        if (c->cfd >= 0) reset_fd(self, c->cfd);
        if (c->bfd >= 0) reset_fd(self, c->bfd);
    } else {
        if (c->cfd >= 0) close(c->cfd);
        if (c->bfd >= 0) close(c->bfd);
    }
    c->cfd = c->bfd = -1;
    int r = 0;
    if (self->out && c->listener) {
        PyObject *items[] = {PyLong_FromLong(EV_CLOSED), Py_NewRef(c->listener),
                             Py_NewRef(c->data ? c->data : Py_None),
                             PyLong_FromUnsignedLongLong(c->in.bytes),
                             PyLong_FromUnsignedLongLong(c->out.bytes), PyLong_FromLong(how),
                             PyLong_FromLong(c->in.spliced + c->out.spliced)};
        r = emit(self, tuple_of(7, items));
    }
    conn_free(self, c);
    return r;
}

/* ---- moving bytes ------------------------------------------------------------------------ */

enum { P_IDLE = 0, P_WAIT = 1, P_MORE = 2, P_DONE = 3, P_ERROR = 4 };

/* A side's read flags: ready to read, and its peer's FIN seen (read until EOF, short or not). */
enum { RD_READY = 1, RD_HUP = 2 };

/* Switch a direction to splice: its buffer is empty here. */
static void dir_to_splice(Core *self, dir_t *d) {
    if (d->b) {
        buf_put(self, d->b);
        d->b = NULL;
    }
    d->off = d->len = 0;
    d->p = pipe_get(self);
    if (d->p) {
        self->spliced++;
        d->spliced = 1;
    }
}

/* Move src -> dst until src is drained, dst is full, EOF or an error, at most PUMP_TURNS
 * reads. `rd`/`wr` are the readiness flags of src and dst (edge-triggered: cleared here when
 * a call says EAGAIN or a read comes back short, set again by the next event). */
static int pump(Core *self, conn *c, dir_t *d, int src, int dst, uint8_t *rd, uint8_t *wr,
                int other_done) {
    for (int turn = 0; turn < PUMP_TURNS; turn++) {
        /* First what is held. */
        if (d->p && d->in_pipe) {
            ssize_t n = splice(d->p->r, NULL, dst, NULL, d->in_pipe, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n < 0) {
                if (errno == EAGAIN) { *wr = 0; return P_WAIT; }
                if (errno == EINTR) continue;
                return P_ERROR;
            }
            d->in_pipe -= (size_t)n;
            if (d->in_pipe) { *wr = 0; return P_WAIT; }
        } else if (d->len > d->off) {
            ssize_t n = send(dst, d->b->data + d->off, d->len - d->off, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n < 0) {
                if (errno == EAGAIN) { *wr = 0; return P_WAIT; }
                if (errno == EINTR) continue;
                return P_ERROR;
            }
            d->off += (uint32_t)n;
            if (d->off < d->len) { *wr = 0; return P_WAIT; }
        }
        if (d->b && d->off >= d->len) {
            buf_put(self, d->b);
            d->b = NULL;
            d->off = d->len = 0;
        }
        if (d->eof) {
            if (!d->done) {
                d->done = 1;
                /* The last direction to end needs no shutdown: the close sends the FIN. */
                if (!other_done) shutdown(dst, SHUT_WR);
            }
            return P_DONE;
        }
        if (!*rd) return P_IDLE;
        /* Then read more. */
        if (d->p) {
            ssize_t n = splice(src, NULL, d->p->w, NULL, d->p->cap, SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n < 0) {
                if (errno == EAGAIN) { *rd = 0; return P_IDLE; }
                if (errno == EINTR) continue;
                if ((errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) && !d->piped) {
                    /* Not for these sockets: copy from now on, here and in new connections. */
                    pipe_put(self, d->p, 0);
                    d->p = NULL;
                    c->splice_ok = 0;
                    self->splice_global = 0;
                    self->splice_unsupported++;
                    continue;
                }
                return P_ERROR;
            }
            if (n == 0) { d->eof = 1; *rd = 0; continue; }
            d->in_pipe = (size_t)n;
            d->bytes += (uint64_t)n;
            d->piped = 1;
            continue;
        }
        if (!d->b) {
            d->b = buf_get(self);
            if (!d->b) return P_ERROR;
        }
        ssize_t n = recv(src, d->b->data, self->bufsize, 0);
        if (n < 0) {
            if (errno == EAGAIN) {
                *rd = 0;
                buf_put(self, d->b);
                d->b = NULL;
                return P_IDLE;
            }
            if (errno == EINTR) continue;
            return P_ERROR;
        }
        if (n == 0) {
            d->eof = 1;
            *rd = 0;
            buf_put(self, d->b);
            d->b = NULL;
            continue;
        }
        d->off = 0;
        d->len = (uint32_t)n;
        d->bytes += (uint64_t)n;
        if ((size_t)n < self->bufsize) {
            /* A short read: the socket is drained (the next byte brings an edge), unless the
             * peer's FIN came with the data (RD_HUP): then the next read says EOF. */
            if (!(*rd & RD_HUP)) *rd = 0;
            d->full_reads = 0;
        } else if (c->splice_ok && self->splice_global && ++d->full_reads >= SPLICE_AFTER) {
            /* Bulk: write out what was read, then splice from the next read on. */
            d->full_reads = 0;
            ssize_t w = send(dst, d->b->data, d->len, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w == (ssize_t)d->len) {
                dir_to_splice(self, d);
                continue;
            }
            if (w < 0 && errno != EAGAIN && errno != EINTR) return P_ERROR;
            if (w > 0) d->off = (uint32_t)w;
            *wr = 0;
            return P_WAIT;
        }
    }
    /* Out of turns: what the last turn read still waits to be written, or more to read, or
     * the EOF it read still waits to be passed on (no event will come for it: the source is
     * done). */
    return (*rd || d->len > d->off || d->in_pipe || (d->eof && !d->done)) ? P_MORE : P_IDLE;
}

/* Run both directions of an open connection; end it when both are done or on an error. */
static int conn_pump(Core *self, conn *c) {
    int a = pump(self, c, &c->in, c->cfd, c->bfd, &c->c_rd, &c->b_wr, c->out.done);
    if (a == P_ERROR) return conn_end(self, c, END_RESET);
    int b = pump(self, c, &c->out, c->bfd, c->cfd, &c->b_rd, &c->c_wr, c->in.done);
    if (b == P_ERROR) return conn_end(self, c, END_RESET);
    if (c->in.done && c->out.done) return conn_end(self, c, END_NORMAL);
    if (a == P_MORE || b == P_MORE) queue(self, c);
    return 0;
}

/* ---- dialing ------------------------------------------------------------------------------ */

static int outcome_of(int err) {
    switch (err) {
    case ECONNREFUSED: return DIAL_REFUSED;
    case ETIMEDOUT: return DIAL_TIMED_OUT;
    case EMFILE: case ENFILE: case ENOBUFS: case ENOMEM: return DIAL_NO_DESCRIPTORS;
    default: return DIAL_UNREACHABLE;
    }
}

/* The dial failed: its socket is closed, the client waits for Python's next word. */
static int dial_failed(Core *self, conn *c, int outcome, int err) {
    deadline_drop(self, c);
    if (c->bfd >= 0) {
        close(c->bfd);
        c->bfd = -1;
    }
    c->state = C_WAITING;
    if (c->fast) return emit_fast(self, c, outcome, err);
    PyObject *id = conn_id(self, c);
    if (!id) return -1;
    return emit_dialed(self, c, id, outcome, err);
}

/* The endpoint answered: report it, take the client on, and start moving bytes. */
static int dial_connected(Core *self, conn *c, int64_t now) {
    deadline_drop(self, c);
    c->state = C_OPEN;
    c->b_wr = 1;
    c->c_rd = c->c_wr = 1;  /* a new descriptor is treated as ready: read before registering */
    ka_add(self, c, now);
    if (c->fast) {
        if (emit_fast(self, c, DIAL_CONNECTED, 0) < 0) return -1;
    } else {
        PyObject *id = conn_id(self, c);
        if (!id) return -1;
        if (emit_dialed(self, c, id, DIAL_CONNECTED, 0) < 0) return -1;
    }
    size_t index = conn_index(self, c);
    int r = conn_pump(self, c);
    if (r < 0) return r;
    if (c->state != C_OPEN) return 0;  /* it ended at once */
    struct epoll_event ev;
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.u64 = ((uint64_t)index << 2) | TAG_CLIENT;
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, c->cfd, &ev) < 0) return conn_end(self, c, END_RESET);
    return 0;
}

/* Connect a new socket to `sa` for the waiting connection `c` (`bind_host`: transparent
 * mode's source, bound with IP(V6)_TRANSPARENT); the outcome comes back as an event, never
 * from here. 0, or -1 with an exception, or -2: `bind_host` is not an address of the family.
 * `in_turn`: called inside a turn (the batch is being built: no wake-up needed). */
static int dial_start(Core *self, conn *c, const struct sockaddr *sa, socklen_t sl,
                      const char *bind_host, int timeout_ms, int in_turn) {
    int family = sa->sa_family;
    int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int err = 0;
    if (fd >= 0) {
        int nodelay = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
    }
    if (fd < 0) {
        err = errno;
    } else if (bind_host && *bind_host) {
        struct sockaddr_storage bs;
        memset(&bs, 0, sizeof(bs));
        int one = 1, ok;
        socklen_t bl;
        if (strchr(bind_host, ':')) {
            struct sockaddr_in6 *b = (struct sockaddr_in6 *)&bs;
            b->sin6_family = AF_INET6;
            ok = inet_pton(AF_INET6, bind_host, &b->sin6_addr) == 1 && family == AF_INET6;
            bl = sizeof(*b);
            if (ok && setsockopt(fd, IPPROTO_IPV6, IPV6_TRANSPARENT, &one, sizeof(one)) < 0) err = errno;
        } else {
            struct sockaddr_in *b = (struct sockaddr_in *)&bs;
            b->sin_family = AF_INET;
            ok = inet_pton(AF_INET, bind_host, &b->sin_addr) == 1 && family == AF_INET;
            bl = sizeof(*b);
            if (ok && setsockopt(fd, IPPROTO_IP, IP_TRANSPARENT, &one, sizeof(one)) < 0) err = errno;
            if (ok && !err) setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
        }
        if (!ok) {
            close(fd);
            return -2;
        }
        if (!err && bind(fd, (struct sockaddr *)&bs, bl) < 0) err = errno;
    }
    if (fd >= 0 && !err && connect(fd, sa, sl) < 0 && errno != EINPROGRESS) err = errno;
    if (fd >= 0 && !err) {
        struct epoll_event ev;
        ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
        ev.data.u64 = ((uint64_t)conn_index(self, c) << 2) | TAG_BACKEND;
        if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) err = errno;
    }
    if (err) {
        if (fd >= 0) close(fd);
        /* The outcome travels as an event, as every other does: outside a turn, run() is
         * asked for by a write to the wake-up eventfd. */
        c->bfd = -1;
        if (!self->out) {
            self->out = PyList_New(0);
            if (!self->out) return -1;
        }
        if (dial_failed(self, c, outcome_of(err), err) < 0) return -1;
        if (!in_turn && !self->woken) {
            uint64_t one = 1;
            if (write(self->efd, &one, sizeof(one)) == sizeof(one)) self->woken = 1;
        }
        return 0;
    }
    c->bfd = fd;
    c->state = C_DIALING;
    deadline_add(self, c, now_ns() + (int64_t)timeout_ms * 1000000LL);
    return 0;
}

/* The table's next entry (its cursor moves on); NULL when it is disabled or empty. */
static tentry *table_next(Table *t) {
    if (!t->enabled || t->count <= 0) return NULL;
    Py_ssize_t i = t->cursor;
    if (i < 0 || i >= t->count) i = 0;
    t->cursor = i + 1 < t->count ? i + 1 : 0;
    t->picks++;
    return &t->entries[i];
}

/* ---- events ------------------------------------------------------------------------------ */

/* A client address as text and a port (host: INET6_ADDRSTRLEN bytes). */
static void peer_text(const struct sockaddr *sa, char *host, int *port) {
    host[0] = 0;
    *port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
        const uint8_t *b = (const uint8_t *)&a->sin_addr;
        /* What inet_ntop writes, without its printf. */
        char *h = host;
        for (int k = 0; k < 4; k++) {
            unsigned v = b[k];
            if (k) *h++ = '.';
            if (v >= 100) *h++ = (char)('0' + v / 100);
            if (v >= 10) *h++ = (char)('0' + v / 10 % 10);
            *h++ = (char)('0' + v % 10);
        }
        *h = 0;
        *port = ntohs(a->sin_port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, host, INET6_ADDRSTRLEN);
        *port = ntohs(a->sin6_port);
    }
}

static int on_listener(Core *self, size_t lid) {
    lslot *l = &self->ls[lid];
    for (int i = 0; i < ACCEPT_BURST && l->used && l->fd >= 0; i++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        int fd = accept4(l->fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EINTR) return 0;
            if (errno == ECONNABORTED || errno == EPROTO || errno == EPERM) continue;
            return emit(self, Py_BuildValue("(iOi)", EV_ACCEPT_ERROR, l->obj, errno));
        }
        size_t index;
        conn *c = conn_new(self, &index);
        if (!c) {
            close(fd);
            PyErr_NoMemory();
            return -1;
        }
        c->cfd = fd;
        c->family = ss.ss_family;
        c->state = C_WAITING;
        c->listener = Py_NewRef(l->obj);
        c->ka_idle = l->ka_idle;
        c->ka_intvl = l->ka_intvl;
        c->ka_user = l->ka_user;
        c->splice_ok = l->splice_ok;
        tentry *te = l->table ? table_next((Table *)l->table) : NULL;
        if (te) {
            /* The table's pick, dialed here: Python hears of it with the outcome. */
            struct sockaddr_storage to;
            socklen_t tl = te->len;
            memcpy(&to, &te->addr, sizeof(to));
            c->fast = 1;
            c->entry = Py_NewRef(te->entry);
            memcpy(&c->peer, &ss, sl < sizeof(c->peer) ? sl : sizeof(c->peer));
            if (dial_start(self, c, (struct sockaddr *)&to, tl, NULL,
                           ((Table *)l->table)->timeout_ms, 1) < 0)
                return -1;
            continue;
        }
        char host[INET6_ADDRSTRLEN];
        int port;
        peer_text((struct sockaddr *)&ss, host, &port);
        PyObject *items[] = {PyLong_FromLong(EV_ACCEPTED), Py_NewRef(l->obj), conn_id(self, c),
                             PyUnicode_FromString(host), PyLong_FromLong(port)};
        if (emit(self, tuple_of(5, items)) < 0) return -1;
    }
    return 0;
}

static int on_backend_while_dialing(Core *self, conn *c, uint32_t events, int64_t now) {
    if (events & (EPOLLERR | EPOLLHUP)) {
        int err = 0;
        socklen_t len = sizeof(err);
        getsockopt(c->bfd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (!err) err = ECONNRESET;
        return dial_failed(self, c, outcome_of(err), err);
    }
    if (events & EPOLLOUT) {
        if (events & EPOLLIN) c->b_rd = RD_READY;
        if (events & (EPOLLRDHUP | EPOLLHUP)) c->b_rd |= RD_READY | RD_HUP;
        return dial_connected(self, c, now);
    }
    return 0;
}

static int on_timers(Core *self, int64_t now) {
    uint64_t expirations;
    if (read(self->tfd, &expirations, sizeof(expirations)) < 0 && errno != EAGAIN) return 0;
    self->armed = 0;
    while (self->thead && self->thead->deadline <= now) {
        conn *c = self->thead;
        if (dial_failed(self, c, DIAL_TIMED_OUT, ETIMEDOUT) < 0) return -1;
    }
    while (self->khead && self->khead->ka_at <= now) {
        conn *c = self->khead;
        ka_drop(self, c);
        if (c->state == C_OPEN && c->bfd >= 0) set_keepalive(c->bfd, c);
    }
    timer_arm(self);
    return 0;
}

/* ---- the Python type ---------------------------------------------------------------------- */

static void close_fds(Core *self);

static int Core_init(Core *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer_size", "pipe_size", "max_events", "keep_buffers",
                             "keep_pipes", NULL};
    Py_ssize_t bufsize = 16384, pipe_size = 1 << 20, keep_bufs = 256, keep_pipes = 64;
    int max_events = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nninn", kwlist, &bufsize, &pipe_size,
                                     &max_events, &keep_bufs, &keep_pipes))
        return -1;
    if (self->ready || self->epfd) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialized already");
        return -1;
    }
    if (bufsize < 1024 || bufsize > (1 << 24) || max_events < 1 || max_events > 65536 ||
        pipe_size < 4096 || keep_bufs < 0 || keep_pipes < 0) {
        PyErr_SetString(PyExc_ValueError, "Core: a size out of range");
        return -1;
    }
    self->bufsize = (size_t)bufsize;
    self->pipe_size = (size_t)pipe_size;
    self->keep_bufs = (size_t)keep_bufs;
    self->keep_pipes = (size_t)keep_pipes;
    self->max_events = max_events;
    self->splice_global = 1;
    self->events = PyMem_Calloc((size_t)max_events, sizeof(struct epoll_event));
    if (!self->events) {
        PyErr_NoMemory();
        return -1;
    }
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    self->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    self->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->epfd < 0 || self->tfd < 0 || self->efd < 0) {
        close_fds(self);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev;
    ev.events = EPOLLIN;
    ev.data.u64 = ((uint64_t)SPECIAL_TIMER << 2) | TAG_SPECIAL;
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->tfd, &ev) < 0) goto fail;
    ev.data.u64 = ((uint64_t)SPECIAL_WAKE << 2) | TAG_SPECIAL;
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->efd, &ev) < 0) goto fail;
    self->ready = 1;
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

static void close_fds(Core *self) {
    if (self->epfd > 0) close(self->epfd);
    if (self->tfd > 0) close(self->tfd);
    if (self->efd > 0) close(self->efd);
    self->epfd = self->tfd = self->efd = -1;
    self->ready = 0;
}

static void close_all(Core *self) {
    self->qhead = self->qtail = NULL;
    for (size_t s = 0; s < self->nslabs; s++) {
        for (size_t i = 0; i < SLAB; i++) {
            conn *c = &self->slabs[s][i];
            if (c->state == C_FREE) continue;
            if (c->cfd >= 0) close(c->cfd);
            if (c->bfd >= 0) close(c->bfd);
            c->cfd = c->bfd = -1;
            c->queued = 0;
            conn_free(self, c);
        }
    }
}

static int Core_traverse(Core *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    for (size_t i = 0; i < self->nls; i++) {
        Py_VISIT(self->ls[i].obj);
        Py_VISIT(self->ls[i].table);
    }
    for (size_t s = 0; s < self->nslabs; s++) {
        for (size_t i = 0; i < SLAB; i++) {
            conn *c = &self->slabs[s][i];
            if (c->state == C_FREE) continue;
            Py_VISIT(c->listener);
            Py_VISIT(c->data);
            Py_VISIT(c->entry);
        }
    }
    return 0;
}

static int Core_clear(Core *self) {
    close_all(self);
    for (size_t i = 0; i < self->nls; i++) {
        Py_CLEAR(self->ls[i].obj);
        Py_CLEAR(self->ls[i].table);
    }
    Py_CLEAR(self->out);
    return 0;
}

static void Core_dealloc(Core *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Core_clear(self);
    for (size_t s = 0; s < self->nslabs; s++) PyMem_Free(self->slabs[s]);
    PyMem_Free(self->slabs);
    PyMem_Free(self->ls);
    PyMem_Free(self->events);
    while (self->free_bufs) {
        buf *b = self->free_bufs;
        self->free_bufs = b->next;
        PyMem_Free(b);
    }
    while (self->free_pipes) {
        pipe_ *p = self->free_pipes;
        self->free_pipes = p->next;
        pipe_close(p);
    }
    close_fds(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int check(Core *self) {
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Core is closed");
        return -1;
    }
    return 0;
}

static PyObject *Core_fileno(Core *self, PyObject *Py_UNUSED(ignored)) {
    if (check(self) < 0) return NULL;
    return PyLong_FromLong(self->epfd);
}

/* add_listener(fd, obj, keepalive_idle, keepalive_interval, user_timeout_ms, splice) -> id.
 * `fd` stays the caller's (a listening socket it owns); `obj` comes back with its events. */
static PyObject *Core_add_listener(Core *self, PyObject *args) {
    int fd, idle, intvl, user, splice_ok;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "iOiiip", &fd, &obj, &idle, &intvl, &user, &splice_ok)) return NULL;
    if (check(self) < 0) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "add_listener: a negative descriptor");
        return NULL;
    }
    size_t lid = 0;
    while (lid < self->nls && self->ls[lid].used) lid++;
    if (lid == self->nls) {
        if (self->nls == self->capls) {
            size_t cap = self->capls ? self->capls * 2 : 16;
            lslot *ls = PyMem_Realloc(self->ls, cap * sizeof(lslot));
            if (!ls) return PyErr_NoMemory();
            self->ls = ls;
            self->capls = cap;
        }
        self->nls++;
    }
    struct epoll_event ev;
    ev.events = EPOLLIN;
    ev.data.u64 = ((uint64_t)lid << 2) | TAG_LISTENER;
    /* No Nagle on either side, as uvloop's transports (the Python data plane): accepted
     * sockets inherit it from the listening socket, a dialed one gets it after socket(). */
    int nodelay = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        if (lid == self->nls - 1) self->nls--;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    lslot *l = &self->ls[lid];
    l->fd = fd;
    l->obj = Py_NewRef(obj);
    l->ka_idle = idle;
    l->ka_intvl = intvl;
    l->ka_user = user;
    l->splice_ok = (uint8_t)splice_ok;
    l->table = NULL;
    l->used = 1;
    return PyLong_FromSize_t(lid);
}

static PyTypeObject *TableType;  /* set when the module is made */

/* The listener slot of `arg` (an id from add_listener), or NULL with a KeyError. */
static lslot *listener_of(Core *self, PyObject *arg) {
    Py_ssize_t lid = PyLong_AsSsize_t(arg);
    if (lid == -1 && PyErr_Occurred()) return NULL;
    if (check(self) < 0) return NULL;
    if (lid < 0 || (size_t)lid >= self->nls || !self->ls[lid].used) {
        PyErr_SetString(PyExc_KeyError, "no such listener");
        return NULL;
    }
    return &self->ls[lid];
}

/* use_table(id, table): the listener dials from `table` while it is enabled (None: never). */
static PyObject *Core_use_table(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "use_table(listener_id, table)");
        return NULL;
    }
    lslot *l = listener_of(self, args[0]);
    if (!l) return NULL;
    PyObject *table = args[1];
    if (table != Py_None && !PyObject_TypeCheck(table, TableType)) {
        PyErr_Format(PyExc_TypeError, "use_table: a Table or None, not %.50s",
                     Py_TYPE(table)->tp_name);
        return NULL;
    }
    Py_XSETREF(l->table, table == Py_None ? NULL : Py_NewRef(table));
    Py_RETURN_NONE;
}

/* peer(conn) -> (host, port): the client of a connection a table dialed (to dial again). */
static PyObject *Core_peer(Core *self, PyObject *id) {
    if (check(self) < 0) return NULL;
    conn *c = conn_of(self, id);
    if (!c) return NULL;
    char host[INET6_ADDRSTRLEN];
    int port;
    peer_text(&c->peer.sa, host, &port);
    return Py_BuildValue("(si)", host, port);
}

static PyObject *Core_remove_listener(Core *self, PyObject *arg) {
    lslot *l = listener_of(self, arg);
    if (!l) return NULL;
    epoll_ctl(self->epfd, EPOLL_CTL_DEL, l->fd, NULL);  /* ENOENT/EBADF: gone already */
    l->used = 0;
    l->fd = -1;
    Py_CLEAR(l->obj);
    Py_CLEAR(l->table);
    Py_RETURN_NONE;
}

/* dial(conn, host, port, timeout_ms, data, header=b"", bind_host=None): connect a new socket
 * to (host, port) for the waiting connection `conn`; `header` goes first (PROXY protocol),
 * `bind_host` (transparent mode) is bound with IP(V6)_TRANSPARENT. The outcome comes back as an
 * EV_DIALED event, never from this call. */
/* A str argument as a C string: a TypeError if it is not a str, a ValueError if it holds a
 * NUL (what PyArg_Parse's "s" says). */
static const char *c_string(PyObject *arg, const char *name) {
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "dial: %s must be str, not %.50s", name,
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t size;
    const char *s = PyUnicode_AsUTF8AndSize(arg, &size);
    if (s && strlen(s) != (size_t)size) {
        PyErr_Format(PyExc_ValueError, "dial: %s holds a NUL character", name);
        return NULL;
    }
    return s;
}

/* `host` (an IPv4 or IPv6 address, no name) and `port` as a sockaddr; -1: not an address. */
static int sockaddr_of(const char *host, int port, struct sockaddr_storage *ss, socklen_t *sl) {
    memset(ss, 0, sizeof(*ss));
    if (strchr(host, ':')) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        *sl = sizeof(*a);
        return inet_pton(AF_INET6, host, &a->sin6_addr) == 1 ? 0 : -1;
    }
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)port);
    *sl = sizeof(*a);
    return inet_pton(AF_INET, host, &a->sin_addr) == 1 ? 0 : -1;
}

/* An int argument: a TypeError if it is not an int, an OverflowError out of C int's range. */
static int c_int(PyObject *arg, const char *name, int *out) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "dial: %s must be int, not %.50s", name,
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "dial: %s out of range", name);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* dial(conn, host, port, timeout_ms, data, header=b'', bind_host=None), positional only: once
 * per dial, so its arguments are taken as they come (METH_FASTCALL), not through a format. */
static PyObject *Core_dial(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 5 || nargs > 7) {
        PyErr_Format(PyExc_TypeError, "dial() takes 5 to 7 positional arguments (%zd given)",
                     nargs);
        return NULL;
    }
    PyObject *id = args[0], *data = args[4];
    const char *host = c_string(args[1], "host"), *bind_host = NULL;
    int port, timeout_ms;
    if (!host || c_int(args[2], "port", &port) < 0 || c_int(args[3], "timeout_ms", &timeout_ms) < 0)
        return NULL;
    if (nargs > 6 && args[6] != Py_None && !(bind_host = c_string(args[6], "bind_host")))
        return NULL;
    Py_buffer header = {0};
    if (nargs > 5 && PyObject_GetBuffer(args[5], &header, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL;
    if (check(self) < 0) goto done;
    conn *c = conn_of(self, id);
    if (!c) goto done;
    if (c->state != C_WAITING) {
        PyErr_SetString(PyExc_RuntimeError, "dial: the connection is not waiting for a dial");
        goto done;
    }
    if (port <= 0 || port > 65535 || timeout_ms <= 0 || (size_t)header.len > self->bufsize) {
        PyErr_SetString(PyExc_ValueError, "dial: port, timeout or header out of range");
        goto done;
    }
    struct sockaddr_storage ss;
    socklen_t sl;
    if (sockaddr_of(host, port, &ss, &sl) < 0) goto bad_address;
    Py_XSETREF(c->data, Py_NewRef(data));
    /* The header replaces whatever an earlier attempt queued (nothing was sent then). */
    dir_release(self, &c->in);
    if (header.len > 0) {
        c->in.b = buf_get(self);
        if (!c->in.b) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(c->in.b->data, header.buf, (size_t)header.len);
        c->in.len = (uint32_t)header.len;
    }
    int r = dial_start(self, c, (struct sockaddr *)&ss, sl, bind_host, timeout_ms, 0);
    if (r == -2) goto bad_address;
    if (r == 0) result = Py_NewRef(Py_None);
    goto done;
bad_address:
    PyErr_Format(PyExc_ValueError, "dial: not an IP address of the right family: %s", host);
done:
    if (header.obj) PyBuffer_Release(&header);
    return result;
}

/* reset(conn): the client of a waiting connection gets a RST (no endpoint, or every dial
 * failed); an open one is reset on both sides. */
static PyObject *Core_reset(Core *self, PyObject *id) {
    if (check(self) < 0) return NULL;
    conn *c = conn_of(self, id);
    if (!c) return NULL;
    if (c->state == C_OPEN) {
        PyObject *saved = self->out;
        self->out = NULL;  /* Python asked for it: no EV_CLOSED */
        conn_end(self, c, END_RESET);
        self->out = saved;
        Py_RETURN_NONE;
    }
    if (c->bfd >= 0) close(c->bfd);
    c->bfd = -1;
    if (c->cfd >= 0) reset_fd(self, c->cfd);
    c->cfd = -1;
    conn_free(self, c);
    Py_RETURN_NONE;
}

/* fileno(conn) -> the client's descriptor, for a getsockopt Python needs (SO_ORIGINAL_DST). */
static PyObject *Core_client_fd(Core *self, PyObject *id) {
    if (check(self) < 0) return NULL;
    conn *c = conn_of(self, id);
    if (!c) return NULL;
    return PyLong_FromLong(c->cfd);
}

/* Wait up to `timeout_ms` (0: do not wait; the GIL is released while waiting), then handle
 * every ready event. Returns the batch for Python (the events built so far included), or NULL
 * with an exception. The readiness of descriptors Python watches through `watch_fd` is
 * appended to `ready` as (fd, mask) with the selectors module's EVENT_READ (1) and
 * EVENT_WRITE (2). *interrupted is set when the wait was interrupted by a signal. */
static PyObject *core_turn(Core *self, int timeout_ms, PyObject *ready, int *interrupted) {
    if (check(self) < 0) return NULL;
    PyObject *out = self->out ? self->out : PyList_New(0);
    if (!out) return NULL;
    self->out = out;
    int n;
    if (timeout_ms == 0) {
        n = epoll_wait(self->epfd, self->events, self->max_events, 0);
    } else {
        Py_BEGIN_ALLOW_THREADS
        n = epoll_wait(self->epfd, self->events, self->max_events, timeout_ms);
        Py_END_ALLOW_THREADS
    }
    if (n < 0) {
        if (errno != EINTR) {
            self->out = NULL;
            Py_DECREF(out);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        n = 0;
        if (interrupted) *interrupted = 1;
    }
    int64_t now = now_ns();
    /* What stopped at its turn limit last time goes first. */
    conn *q = self->qhead;
    self->qhead = self->qtail = NULL;
    while (q) {
        conn *next = q->qnext;
        q->queued = 0;
        if (q->state == C_OPEN) {
            if (conn_pump(self, q) < 0) goto error;
        } else if (q->state == C_FREE) {
            q->free_next = self->free_conns;  /* freed while queued: its slot is free now */
            self->free_conns = q;
        }
        q = next;
    }
    for (int i = 0; i < n; i++) {
        uint64_t tag = self->events[i].data.u64;
        uint32_t events = self->events[i].events;
        size_t index = (size_t)(tag >> 2);
        switch (tag & 3) {
        case TAG_LISTENER:
            if (index < self->nls && self->ls[index].used && on_listener(self, index) < 0)
                goto error;
            break;
        case TAG_SPECIAL:
            if (index == SPECIAL_TIMER) {
                if (on_timers(self, now) < 0) goto error;
            } else if (index == SPECIAL_WAKE) {
                uint64_t v;
                if (read(self->efd, &v, sizeof(v)) < 0 && errno != EAGAIN) break;
                self->woken = 0;
            } else if (ready) {  /* a descriptor Python watches (watch_fd) */
                long mask = 0;
                if (events & ~(uint32_t)EPOLLOUT) mask |= 1;
                if (events & ~(uint32_t)EPOLLIN) mask |= 2;
                PyObject *items[] = {PyLong_FromSsize_t((Py_ssize_t)(index - SPECIAL_FDS)),
                                     PyLong_FromLong(mask)};
                PyObject *item = tuple_of(2, items);
                if (!item) goto error;
                int r = PyList_Append(ready, item);
                Py_DECREF(item);
                if (r < 0) goto error;
            }
            break;
        default: {
            conn *c = conn_at(self, index);
            if (!c || c->state == C_FREE) break;
            int backend = (tag & 3) == TAG_BACKEND;
            if (c->state == C_DIALING) {
                if (backend && on_backend_while_dialing(self, c, events, now) < 0) goto error;
                break;
            }
            if (c->state != C_OPEN) break;
            if (events & EPOLLERR) {  /* a reset (or an ICMP error): passed on as a reset */
                if (conn_end(self, c, END_RESET) < 0) goto error;
                break;
            }
            uint8_t *rd = backend ? &c->b_rd : &c->c_rd;
            uint8_t *wr = backend ? &c->b_wr : &c->c_wr;
            if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) *rd |= RD_READY;
            if (events & (EPOLLRDHUP | EPOLLHUP)) *rd |= RD_HUP;
            if (events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) *wr = 1;
            if (conn_pump(self, c) < 0) goto error;
        }
        }
    }
    self->out = NULL;
    return out;
error:
    self->out = NULL;
    Py_DECREF(out);
    return NULL;
}

/* run() -> the batch of events: [(kind, ...), ...]. */
static PyObject *Core_run(Core *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = core_turn(self, 0, NULL, NULL);
    if (out && self->qhead && !self->woken) {  /* the rest of the work: another wakeup */
        uint64_t one = 1;
        if (write(self->efd, &one, sizeof(one)) == sizeof(one)) self->woken = 1;
    }
    return out;
}

/* callable(arg): whether it asks for the loop's turn (1), not (0), or an exception (-1). */
static int call_for_turn(PyObject *callable, PyObject *arg) {
    PyObject *r = PyObject_CallOneArg(callable, arg);
    if (!r) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* select(timeout_ms, handler, io_handler=None) -> [(fd, mask), ...]: the wait of an event loop
 * whose selector this core is (coreloop.py). It waits for the descriptors Python watches
 * (watch_fd) and the core's own together, moves bytes in C, and calls `handler(batch)` for
 * each batch of core events that needs Python and `io_handler(ready)` for the watched
 * descriptors that are ready (without one, it returns them). Either returns true when the loop
 * has callbacks to run. The wait returns to the loop when that happens, a signal interrupts
 * it, the timeout (ms; -1: none) passes, or the core is closed. */
static PyObject *Core_select(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "select(timeout_ms, handler, io_handler=None)");
        return NULL;
    }
    long timeout_ms = PyLong_AsLong(args[0]);
    if (timeout_ms == -1 && PyErr_Occurred()) return NULL;
    PyObject *handler = args[1], *io_handler = nargs > 2 ? args[2] : Py_None;
    if (!PyCallable_Check(handler) || (io_handler != Py_None && !PyCallable_Check(io_handler))) {
        PyErr_SetString(PyExc_TypeError, "select: the handlers must be callable");
        return NULL;
    }
    if (io_handler == Py_None) io_handler = NULL;
    if (timeout_ms > INT_MAX) timeout_ms = INT_MAX;
    int64_t deadline = timeout_ms < 0 ? -1 : now_ns() + (int64_t)timeout_ms * 1000000LL;
    PyObject *ready = NULL;
    for (;;) {
        int wait_ms;
        if (self->qhead) {
            wait_ms = 0;
        } else if (deadline < 0) {
            wait_ms = -1;
        } else {
            int64_t left = deadline - now_ns();
            wait_ms = left <= 0 ? 0 : (int)((left + 999999) / 1000000);
        }
        if (!ready && !(ready = PyList_New(0))) return NULL;
        int interrupted = 0;
        PyObject *out = core_turn(self, wait_ms, ready, &interrupted);
        if (!out) goto error;
        int turn = interrupted;
        int t = PyList_GET_SIZE(out) > 0 ? call_for_turn(handler, out) : 0;
        Py_DECREF(out);
        if (t < 0) goto error;
        turn |= t;
        if (PyList_GET_SIZE(ready) > 0) {
            if (!io_handler) break;  /* the caller takes them */
            t = call_for_turn(io_handler, ready);
            Py_CLEAR(ready);
            if (t < 0) goto error;
            turn |= t;
        }
        if (turn || !self->ready) break;
        if (!self->qhead && deadline >= 0 && now_ns() >= deadline) break;
    }
    return ready ? ready : PyList_New(0);
error:
    Py_XDECREF(ready);
    return NULL;
}

/* watch_fd(fd, mask): watch `fd` (level-triggered) for EVENT_READ (1) and EVENT_WRITE (2), as
 * the selector of an event loop; mask 0 stops watching it. */
static PyObject *Core_watch_fd(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "watch_fd(fd, mask, new)");
        return NULL;
    }
    if (check(self) < 0) return NULL;
    long fd = PyLong_AsLong(args[0]), mask = PyLong_AsLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    int add = PyObject_IsTrue(args[2]);
    if (add < 0) return NULL;
    if (fd < 0 || fd > INT_MAX || fd == self->epfd || mask < 0 || mask > 3) {
        PyErr_SetString(PyExc_ValueError, "watch_fd: not a descriptor this core can watch");
        return NULL;
    }
    if (mask == 0) {
        if (epoll_ctl(self->epfd, EPOLL_CTL_DEL, (int)fd, NULL) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        Py_RETURN_NONE;
    }
    struct epoll_event ev;
    ev.events = ((mask & 1) ? EPOLLIN : 0) | ((mask & 2) ? EPOLLOUT : 0);
    ev.data.u64 = ((uint64_t)(SPECIAL_FDS + (uint64_t)fd) << 2) | TAG_SPECIAL;
    if (epoll_ctl(self->epfd, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, (int)fd, &ev) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* counts() -> [(data, bytes_in, bytes_out), ...] moved by open connections since the last
 * report (the rest comes with their EV_CLOSED): live byte counters at scrape time. */
static PyObject *Core_counts(Core *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (size_t s = 0; s < self->nslabs; s++) {
        for (size_t i = 0; i < SLAB; i++) {
            conn *c = &self->slabs[s][i];
            if (c->state != C_OPEN || (!c->in.bytes && !c->out.bytes)) continue;
            PyObject *item = Py_BuildValue("(OOKK)", c->listener, c->data ? c->data : Py_None,
                                           (unsigned long long)c->in.bytes,
                                           (unsigned long long)c->out.bytes);
            if (!item || PyList_Append(out, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
            c->in.bytes = c->out.bytes = 0;
        }
    }
    return out;
}

/* close_listener(obj, reset=False) -> the EV_CLOSED events of every connection of `obj` (the
 * end of a drain: a FIN each, as a process exit would send; waiting ones are reset). */
static PyObject *Core_close_connections(Core *self, PyObject *args) {
    PyObject *obj;
    int reset = 0;
    if (!PyArg_ParseTuple(args, "O|p", &obj, &reset)) return NULL;
    if (check(self) < 0) return NULL;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    PyObject *saved = self->out;
    self->out = out;
    for (size_t s = 0; s < self->nslabs; s++) {
        for (size_t i = 0; i < SLAB; i++) {
            conn *c = &self->slabs[s][i];
            if (c->state == C_FREE || c->listener != obj) continue;
            if (c->state == C_OPEN) {
                if (conn_end(self, c, reset ? END_RESET : END_CLOSED) < 0) {
                    self->out = saved;
                    Py_DECREF(out);
                    return NULL;
                }
            } else {
                if (c->bfd >= 0) close(c->bfd);
                if (c->cfd >= 0) reset_fd(self, c->cfd);
                c->cfd = c->bfd = -1;
                conn_free(self, c);
            }
        }
    }
    self->out = saved;
    return out;
}

/* buffered(obj) -> bytes held for the connections of `obj`: copy buffers and pipes. */
static PyObject *Core_buffered(Core *self, PyObject *obj) {
    unsigned long long total = 0;
    for (size_t s = 0; s < self->nslabs; s++) {
        for (size_t i = 0; i < SLAB; i++) {
            conn *c = &self->slabs[s][i];
            if (c->state == C_FREE || c->listener != obj) continue;
            total += (c->in.len - c->in.off) + (c->out.len - c->out.off) + c->in.in_pipe +
                     c->out.in_pipe;
        }
    }
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *Core_stats(Core *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:O}",
                         "connections", (Py_ssize_t)self->live,
                         "buffers_in_use", (Py_ssize_t)self->bufs_out,
                         "buffers_idle", (Py_ssize_t)self->nfree_bufs,
                         "pipes_in_use", (Py_ssize_t)self->pipes_out,
                         "pipes_idle", (Py_ssize_t)self->nfree_pipes,
                         "spliced", (unsigned long long)self->spliced,
                         "splice_unsupported", (unsigned long long)self->splice_unsupported,
                         "resets_sent", (unsigned long long)self->resets_sent,
                         "splice", self->splice_global ? Py_True : Py_False);
}

static PyObject *Core_close(Core *self, PyObject *Py_UNUSED(ignored)) {
    close_all(self);
    for (size_t i = 0; i < self->nls; i++) {
        Py_CLEAR(self->ls[i].obj);
        Py_CLEAR(self->ls[i].table);
        self->ls[i].used = 0;
    }
    close_fds(self);
    Py_RETURN_NONE;
}

/* run(), then `handler(batch)` only when the batch has something for Python: the loop's reader
 * callback, so a wakeup that only moved bytes runs no Python frame at all. */
static PyObject *Core_dispatch(Core *self, PyObject *handler) {
    PyObject *out = Core_run(self, NULL);
    if (!out) return NULL;
    if (PyList_GET_SIZE(out) == 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    PyObject *r = PyObject_CallOneArg(handler, out);
    Py_DECREF(out);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"fileno", METH(Core_fileno), METH_NOARGS, "The epoll descriptor to watch."},
    {"add_listener", METH(Core_add_listener), METH_VARARGS,
     "add_listener(fd, obj, keepalive_idle, keepalive_interval, user_timeout_ms, splice) -> id"},
    {"remove_listener", METH(Core_remove_listener), METH_O, "Stop accepting from `id`."},
    {"dial", METH(Core_dial), METH_FASTCALL,
     "dial(conn, host, port, timeout_ms, data, header=b'', bind_host=None)"},
    {"reset", METH(Core_reset), METH_O, "Reset a connection (the client gets a RST)."},
    {"client_fd", METH(Core_client_fd), METH_O, "The client's descriptor of `conn`."},
    {"use_table", METH(Core_use_table), METH_FASTCALL,
     "use_table(listener_id, table): dial from `table` while it is enabled (None: never)."},
    {"peer", METH(Core_peer), METH_O, "peer(conn) -> (host, port) of a table-dialed client."},
    {"run", METH(Core_run), METH_NOARGS, "Handle every ready event; the batch for Python."},
    {"select", METH(Core_select), METH_FASTCALL,
     "select(timeout_ms, handler, io_handler=None) -> [(fd, mask), ...]: an event loop's wait."},
    {"watch_fd", METH(Core_watch_fd), METH_FASTCALL,
     "watch_fd(fd, mask, new): watch fd for read (1) and write (2); mask 0: stop."},
    {"dispatch", METH(Core_dispatch), METH_O,
     "dispatch(handler): run(), then handler(batch) if the batch is not empty."},
    {"counts", METH(Core_counts), METH_NOARGS, "Bytes moved by open connections."},
    {"close_connections", METH(Core_close_connections), METH_VARARGS,
     "close_connections(obj, reset=False) -> the EV_CLOSED events of obj's connections."},
    {"buffered", METH(Core_buffered), METH_O, "Bytes held for obj's connections."},
    {"stats", METH(Core_stats), METH_NOARGS, "The core's own counters."},
    {"close", METH(Core_close), METH_NOARGS, "Close every connection and descriptor."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Core_slots[] = {
    {Py_tp_doc, "The native data plane of one event loop: an epoll set and its connections."},
    {Py_tp_init, Core_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Core_dealloc},
    {Py_tp_traverse, Core_traverse},
    {Py_tp_clear, Core_clear},
    {Py_tp_methods, Core_methods},
    {0, NULL},
};

static PyType_Spec Core_spec = {
    .name = "kube_userspace_proxy.dataplane._native.Core",
    .basicsize = sizeof(Core),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Core_slots,
};

/* ---- Table: a round-robin pool's copy (balancer.py pushes it; see the header) ----------- */

static void table_drop_entries(tentry *entries, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) Py_XDECREF(entries[i].entry);
    PyMem_Free(entries);
}

/* Table(timeout_ms): empty and disabled; a fast dial's deadline is `timeout_ms`. */
static int Table_init(Table *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"timeout_ms", NULL};
    int timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &timeout_ms)) return -1;
    if (timeout_ms <= 0) {
        PyErr_SetString(PyExc_ValueError, "Table: timeout_ms must be positive");
        return -1;
    }
    self->timeout_ms = timeout_ms;
    return 0;
}

/* set(entries, cursor): [(host, port, data), ...] and where the next pick is; enabled while
 * it has entries. On an error nothing changes. */
static PyObject *Table_set(Table *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t cursor;
    if (!PyArg_ParseTuple(args, "On", &seq, &cursor)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "Table.set: entries must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (cursor < 0 || (n > 0 && cursor >= n) || (n == 0 && cursor != 0)) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "Table.set: cursor out of range");
        return NULL;
    }
    tentry *entries = n ? PyMem_Calloc((size_t)n, sizeof(tentry)) : NULL;
    if (n && !entries) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        const char *host;
        int port;
        PyObject *data;
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "siO", &host, &port, &data)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "Table.set: an entry is (host, port, data)");
            goto fail;
        }
        if (port <= 0 || port > 65535 || sockaddr_of(host, port, &entries[i].addr, &entries[i].len) < 0) {
            PyErr_Format(PyExc_ValueError, "Table.set: not an endpoint: %s:%d", host, port);
            goto fail;
        }
        entries[i].entry = Py_BuildValue("(nO)", i, data);
        if (!entries[i].entry) goto fail;
    }
    Py_DECREF(fast);
    tentry *old = self->entries;
    Py_ssize_t old_count = self->count;
    self->entries = entries;
    self->count = n;
    self->cursor = cursor;
    self->enabled = n > 0;
    table_drop_entries(old, old_count);
    Py_RETURN_NONE;
fail:
    Py_DECREF(fast);
    table_drop_entries(entries, n);
    return NULL;
}

/* disable() -> the cursor: no more picks here until the next set(). */
static PyObject *Table_disable(Table *self, PyObject *Py_UNUSED(ignored)) {
    self->enabled = 0;
    return PyLong_FromSsize_t(self->cursor);
}

/* resume(cursor): enabled again, with the entries of the last set(), from `cursor`. */
static PyObject *Table_resume(Table *self, PyObject *arg) {
    Py_ssize_t cursor = PyLong_AsSsize_t(arg);
    if (cursor == -1 && PyErr_Occurred()) return NULL;
    if (self->count <= 0 || cursor < 0 || cursor >= self->count) {
        PyErr_SetString(PyExc_ValueError, "Table.resume: cursor out of range (or no entries)");
        return NULL;
    }
    self->cursor = cursor;
    self->enabled = 1;
    Py_RETURN_NONE;
}

/* pick() -> (index, data) of the next entry, as an accept would dial it; None if disabled. */
static PyObject *Table_pick(Table *self, PyObject *Py_UNUSED(ignored)) {
    tentry *te = table_next(self);
    if (!te) Py_RETURN_NONE;
    return Py_NewRef(te->entry);
}

static PyObject *Table_get_cursor(Table *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->cursor);
}

static PyObject *Table_get_enabled(Table *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->enabled);
}

static PyObject *Table_get_picks(Table *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->picks);
}

static PyObject *Table_get_count(Table *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(self->count);
}

static int Table_traverse(Table *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    for (Py_ssize_t i = 0; i < self->count; i++) Py_VISIT(self->entries[i].entry);
    return 0;
}

static int Table_clear(Table *self) {
    tentry *old = self->entries;
    Py_ssize_t count = self->count;
    self->entries = NULL;
    self->count = 0;
    self->enabled = 0;
    table_drop_entries(old, count);
    return 0;
}

static void Table_dealloc(Table *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Table_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef Table_methods[] = {
    {"set", METH(Table_set), METH_VARARGS,
     "set(entries, cursor): [(host, port, data), ...]; enabled while it has entries."},
    {"disable", METH(Table_disable), METH_NOARGS, "disable() -> cursor: no more picks here."},
    {"resume", METH(Table_resume), METH_O, "resume(cursor): enabled again, same entries."},
    {"pick", METH(Table_pick), METH_NOARGS, "pick() -> (index, data) of the next entry, or None."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"cursor", (getter)Table_get_cursor, NULL, "The index of the next pick.", NULL},
    {"enabled", (getter)Table_get_enabled, NULL, "Whether accepts dial from this table.", NULL},
    {"picks", (getter)Table_get_picks, NULL, "Picks made from this table.", NULL},
    {"count", (getter)Table_get_count, NULL, "Its entries.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Table_slots[] = {
    {Py_tp_doc, "A round-robin pool's endpoints and cursor, copied for accepts to dial from."},
    {Py_tp_init, Table_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, Table_dealloc},
    {Py_tp_traverse, Table_traverse},
    {Py_tp_clear, Table_clear},
    {Py_tp_methods, Table_methods},
    {Py_tp_getset, Table_getset},
    {0, NULL},
};

static PyType_Spec Table_spec = {
    .name = "kube_userspace_proxy.dataplane._native.Table",
    .basicsize = sizeof(Table),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = Table_slots,
};

static int native_exec(PyObject *m) {
    PyObject *type = PyType_FromModuleAndSpec(m, &Core_spec, NULL);
    if (!type) return -1;
    if (PyModule_AddObject(m, "Core", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    PyObject *table = PyType_FromModuleAndSpec(m, &Table_spec, NULL);
    if (!table) return -1;
    TableType = (PyTypeObject *)table;  /* the module holds it as long as a core can see it */
    if (PyModule_AddObject(m, "Table", Py_NewRef(table)) < 0) {
        Py_DECREF(table);
        Py_DECREF(table);
        return -1;
    }
    Py_DECREF(table);
    if (PyModule_AddIntConstant(m, "EV_ACCEPTED", EV_ACCEPTED) < 0 ||
        PyModule_AddIntConstant(m, "EV_DIALED", EV_DIALED) < 0 ||
        PyModule_AddIntConstant(m, "EV_CLOSED", EV_CLOSED) < 0 ||
        PyModule_AddIntConstant(m, "EV_ACCEPT_ERROR", EV_ACCEPT_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "EV_FAST", EV_FAST) < 0 ||
        PyModule_AddIntConstant(m, "DIAL_NO_DESCRIPTORS", DIAL_NO_DESCRIPTORS) < 0 ||
        PyModule_AddIntConstant(m, "END_NORMAL", END_NORMAL) < 0 ||
        PyModule_AddIntConstant(m, "END_RESET", END_RESET) < 0 ||
        PyModule_AddIntConstant(m, "END_CLOSED", END_CLOSED) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kube_userspace_proxy.dataplane._native",
    .m_doc = "The native TCP data plane's mechanism (see native.py for the policy).",
    .m_size = 0,
    .m_slots = native_slots,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&native_module); }
