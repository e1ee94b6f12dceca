/*
 * Connection churn for bench/bench_events.py: short UDP request/response flows at a fixed rate.
 *
 * Written in C because the point is to load the exporter, not the generator: a Python client
 * at 10,000 flows/s would take most of a core on a 2-core machine.
 *
 *   churn server <ip> <port_base> <nports>
 *       answers every datagram on ports port_base..+nports-1 with 50 + (client port % 200) bytes
 *   churn client <src_ip> <dst_ip> <port_base> <nports> <rate> <seconds> <sport_lo> <sport_hi> <status>
 *       flow i: from port sport_lo + i % span to port_base + (i / span) % nports, one datagram of
 *       20 + (client port % 100) bytes, then waits (epoll) for the answer and closes the socket.
 *       Writes one byte per flow to <status> (0 not sent, 1 unanswered within 2 s, 2 answered) and
 *       prints one line at the end: sent, answered, failed, seconds.
 *
 * Each flow is one conntrack entry with exactly 1 packet each way; sizes follow from the ports,
 * so the expected counters of every flow are known without asking the exporter.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int server(const char *ip, int base, int n) {
    int ep = epoll_create1(0);
    for (int i = 0; i < n; i++) {
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(base + i)};
        inet_pton(AF_INET, ip, &a.sin_addr);
        if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) { perror("bind"); return 1; }
        int big = 16 << 20;
        setsockopt(s, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = s};
        epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    }
    char buf[2048], out[512];
    memset(out, 0xa5, sizeof out);
    struct epoll_event evs[64];
    for (;;) {
        int k = epoll_wait(ep, evs, 64, -1);
        for (int j = 0; j < k; j++) {
            for (;;) {
                struct sockaddr_in peer;
                socklen_t len = sizeof peer;
                ssize_t r = recvfrom(evs[j].data.fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&peer, &len);
                if (r < 0) break;
                int resp = 50 + ntohs(peer.sin_port) % 200;
                sendto(evs[j].data.fd, out, resp, 0, (struct sockaddr *)&peer, len);
            }
        }
    }
}

static int client(const char *src, const char *dst, int base, int n, double rate, double seconds, int lo, int hi,
                  const char *status_path) {
    int ep = epoll_create1(0);
    long total = (long)(rate * seconds), span = hi - lo + 1, sent = 0, answered = 0, failed = 0;
    double t0 = now();
    char payload[256], buf[2048];
    memset(payload, 0x5a, sizeof payload);
    /* open sockets: fd -> send time, to time out unanswered ones */
    static long flow_of[1 << 20];
    unsigned char *status = calloc(total + 1, 1);
    long open_count = 0;
    for (long i = 0; i < total || open_count > 0;) {
        double t = now();
        while (i < total && t0 + i / rate <= t) {
            int sport = lo + i % span, dport = base + (i / span) % n;
            int s = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
            if (s < 0 || s >= (1 << 20)) { perror("socket"); return 1; }
            int one = 1;
            setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(sport)};
            inet_pton(AF_INET, src, &a.sin_addr);
            struct sockaddr_in d = {.sin_family = AF_INET, .sin_port = htons(dport)};
            inet_pton(AF_INET, dst, &d.sin_addr);
            i++;
            if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) { close(s); failed++; continue; }
            if (sendto(s, payload, 20 + sport % 100, 0, (struct sockaddr *)&d, sizeof d) < 0) { close(s); failed++; continue; }
            sent++;
            struct epoll_event ev = {.events = EPOLLIN, .data.fd = s};
            epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
            flow_of[s] = i - 1;
            status[i - 1] = 1;
            open_count++;
        }
        struct epoll_event evs[256];
        int k = epoll_wait(ep, evs, 256, 1);
        for (int j = 0; j < k; j++) {
            int s = evs[j].data.fd;
            if (recv(s, buf, sizeof buf, MSG_DONTWAIT) >= 0) {
                answered++;
                status[flow_of[s]] = 2;
            } else {
                failed++;
            }
            close(s);
            open_count--;
        }
        if (i >= total && open_count > 0 && now() - t0 > seconds + 2) {
            failed += open_count;  /* unanswered within 2 s */
            break;
        }
    }
    FILE *f = fopen(status_path, "wb");
    if (!f || fwrite(status, 1, total, f) != (size_t)total) { perror(status_path); return 1; }
    fclose(f);
    printf("%ld %ld %ld %.3f\n", sent, answered, failed, now() - t0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "server")) return server(argv[2], atoi(argv[3]), atoi(argv[4]));
    if (argc == 11 && !strcmp(argv[1], "client"))
        return client(argv[2], argv[3], atoi(argv[4]), atoi(argv[5]), atof(argv[6]), atof(argv[7]), atoi(argv[8]),
                      atoi(argv[9]), argv[10]);
    fprintf(stderr, "usage: churn server IP PORT_BASE NPORTS | churn client SRC DST PORT_BASE NPORTS RATE SECONDS LO HI STATUS\n");
    return 2;
}
