//! Gather reads (`ReadDesc::remote_rows`) across processes: the test binary re-executes itself
//! as a publisher process that registers one region of known bytes, and the receiver here
//! reads rows at a pitch out of it with `process_vm_readv`, byte-exact against the rows the
//! pattern says, under calls small and large enough to cut the rows every way.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;

use reshard_backend_cma::{CmaOptions, CmaTransport};
use reshard_core::{
    CompletionSink, ErrorKind, ExecutionLog, HashPlan, HostBuffer, ReadBatch, ReadDesc, RemoteRows,
    SegmentFold, SegmentTask, Transport,
};

/// Set in the publisher process.
const CHILD_ENV: &str = "RESHARD_CMA_GATHER_PUBLISHER";
/// Bytes of the publisher's region.
const REGION: u64 = 1 << 20;
/// Owner id the receiver loads the publisher under.
const OWNER: u32 = 3;

/// Byte `i` of the publisher's region: differs between neighbours and between rows, so a row
/// read from the wrong place or one byte off does not match.
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (i >> 9) as u8
}

/// The bytes a read must land: its source runs, one after another.
fn expected(r: &ReadDesc) -> Vec<u8> {
    r.remote_runs(0, r.len)
        .flat_map(|(at, _, n)| (at..at + n).map(pattern))
        .collect()
}

/// The publisher process: registers the region, prints its metadata (hex) and region id on
/// stdout, and serves until its stdin closes. A no-op in a normal run.
#[tokio::test]
async fn gather_publisher() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let tx = CmaTransport::new("gather-publisher", CmaOptions::default()).unwrap();
    let bytes: Vec<u8> = (0..REGION).map(pattern).collect();
    let reg = tx
        .register(Arc::new(HostBuffer::from_bytes(&bytes)))
        .await
        .unwrap();
    let meta = tx.export_metadata().await.unwrap();
    let hex: String = meta.iter().map(|b| format!("{b:02x}")).collect();
    println!("META {} {hex}", reg.id());
    std::io::stdout().flush().unwrap();
    // Serve until the receiver closes our stdin (or exits).
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {}
    drop(reg);
}

/// The running publisher process: its region id and metadata. Dropping it closes its stdin,
/// and it exits.
struct Publisher {
    child: Child,
    /// Its stdout, kept open so what it prints after its metadata (its test's result) never
    /// meets a closed pipe.
    _out: BufReader<ChildStdout>,
    region: u64,
    meta: Vec<u8>,
}

impl Publisher {
    fn spawn() -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args([
                "gather_publisher",
                "--exact",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the publisher process");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while out.read_line(&mut line).expect("publisher output") > 0 {
            // libtest may have begun the line with the test's name.
            let Some((_, rest)) = line.trim_end().split_once("META ") else {
                line.clear();
                continue;
            };
            let (region, hex) = rest.split_once(' ').unwrap();
            let meta = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            return Publisher {
                child,
                _out: out,
                region: region.parse().unwrap(),
                meta,
            };
        }
        let status = child.wait();
        panic!("the publisher process exited without its metadata: {status:?}");
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// Reads `len` bytes from `remote_offset` in rows of `row_bytes` at `pitch`, landing at
/// `local_offset` of region `local`.
fn gather(
    p: &Publisher,
    local: u64,
    local_offset: u64,
    remote_offset: u64,
    len: u64,
    rows: Option<(u64, u64)>,
) -> ReadDesc {
    ReadDesc {
        owner: OWNER,
        remote_region: p.region,
        remote_offset,
        local_region: local,
        local_offset,
        len,
        remote_rows: rows.map(|(row_bytes, pitch)| RemoteRows { row_bytes, pitch }),
    }
}

/// Every read of `reads` (into one 1 MiB destination) posted on an endpoint with `options`,
/// once plainly and once hashing while copying (a plan of one segment per read, which cuts
/// each call into 256 KiB system calls, resumed where the last stopped, mid-row too): each
/// post reports every read and byte and lands every read's rows byte-exact and nothing else;
/// every hash stored is that of the read's landed bytes; the execution log records each read
/// as posted, its rows included. Returns how many hashes were stored.
async fn read_exactly(
    p: &Publisher,
    options: CmaOptions,
    reads: impl Fn(u64) -> Vec<ReadDesc>,
) -> usize {
    let what = format!("{options:?}");
    let rx = CmaTransport::new("gather-receiver", options).unwrap();
    rx.load_peer(OWNER, p.meta.clone().into()).await.unwrap();
    let dst = Arc::new(HostBuffer::zeroed(REGION as usize));
    let reg = rx.register(dst.clone()).await.unwrap();
    let log = ExecutionLog::new();
    assert!(rx.set_execution_log(Some(log.clone())));
    let batch = ReadBatch {
        reads: reads(reg.id()),
    };
    let prepared = rx.prepare(batch.clone()).await.unwrap();
    let mut want = vec![0u8; REGION as usize];
    for r in &batch.reads {
        let at = r.local_offset as usize;
        want[at..at + r.len as usize].copy_from_slice(&expected(r));
    }
    let total: u64 = batch.reads.iter().map(|r| r.len).sum();
    let plan = Arc::new(HashPlan::new(
        batch.reads.len(),
        batch.reads.len(),
        batch.reads.iter().enumerate().map(|(i, r)| {
            let task = SegmentTask {
                offset: 0,
                len: r.len as u32,
                slot: i as u32,
            };
            (i, task)
        }),
    ));
    let mut stored = 0;
    for hashed in [false, true] {
        let what = format!("{what}, hashed {hashed}");
        dst.write().fill(0);
        let inflight = if hashed {
            plan.begin();
            let sink = CompletionSink::new(|_| {}).with_hashes(plan.clone());
            rx.post_reporting(&prepared, sink).await.unwrap()
        } else {
            rx.post(&prepared).await.unwrap()
        };
        let report = inflight.wait().await.unwrap();
        assert_eq!(report.reads, batch.reads.len() as u64, "{what}");
        assert_eq!(report.bytes, total, "{what}");
        let got = dst.read();
        if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
            panic!(
                "{what}: byte {i} of the destination is {} not {}",
                got[i], want[i]
            );
        }
        for (i, r) in batch.reads.iter().enumerate().filter(|_| hashed) {
            // A read cut over several calls is several pieces: its one segment straddles them
            // and is not stored (the receiver hashes it itself).
            if let Some(h) = plan.hash(i, r.len) {
                let mut f = SegmentFold::new();
                let at = r.local_offset as usize;
                f.segment(&want[at..at + r.len as usize]);
                assert_eq!(h.to_le_bytes()[..], f.hashes()[..], "{what}: read {i}");
                stored += 1;
            }
        }
        assert_eq!(log.take(), batch.reads, "{what}: the execution log");
    }
    stored
}

/// Options under which the reads below are cut every way: one call per 1024 remote iovecs
/// over two workers, calls of 4 KiB that start and end mid-row, and one iovec per call.
fn option_sets() -> Vec<CmaOptions> {
    let base = CmaOptions {
        workers: 2,
        ..CmaOptions::default()
    };
    vec![
        base.clone(),
        CmaOptions {
            piece_bytes: 4096,
            ..base.clone()
        },
        CmaOptions {
            iovecs_per_call: 1,
            ..base
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_reads_from_another_process_are_byte_exact() {
    reshard_backend_cma::probe().unwrap();
    let p = Publisher::spawn();
    for options in option_sets() {
        // (a) 3000 rows (more than the 1024 iovecs of one call) of 24 bytes every 100 bytes,
        // from an odd offset: three calls or more, on two workers.
        read_exactly(&p, options.clone(), |dst| {
            vec![gather(&p, dst, 0, 7, 3000 * 24, Some((24, 100)))]
        })
        .await;
        // Rows of 1000 bytes: hashed, a call is cut into 256 KiB system calls mid-row; under
        // 8 MiB calls of 1024 iovecs the read is one piece, so its hash is stored.
        let stored = read_exactly(&p, options.clone(), |dst| {
            vec![gather(&p, dst, 0, 3, 600 * 1000, Some((1000, 1500)))]
        })
        .await;
        let one_piece = options.piece_bytes >= 600_000 && options.iovecs_per_call >= 600;
        assert_eq!(stored, usize::from(one_piece), "{options:?}");
        // (b) rows whose pitch is their length: one contiguous source.
        read_exactly(&p, options.clone(), |dst| {
            vec![gather(&p, dst, 5, 300_001, 2000 * 16, Some((16, 16)))]
        })
        .await;
        // (c) gathers and plain reads in one batch, a one-row gather and wide rows included.
        read_exactly(&p, options.clone(), |dst| {
            vec![
                gather(&p, dst, 0, 10, 1000, None),
                gather(&p, dst, 1000, 400_003, 1500 * 10, Some((10, 33))),
                gather(&p, dst, 16_000, 20, 5000, None),
                gather(&p, dst, 21_000, 600_000, 3 * 9000, Some((9000, 10_001))),
                gather(&p, dst, 48_000, REGION - 7, 7, Some((7, 1000))),
                gather(&p, dst, 48_007, 900_000, 1200 * 5, Some((5, 6))),
            ]
        })
        .await;
    }
}

/// (d) A gather whose rows pass the region's end is refused at prepare with `OutOfBounds`
/// naming its whole source span, although its length would fit from its offset.
#[tokio::test]
async fn a_gather_past_the_region_end_is_out_of_bounds_at_prepare() {
    reshard_backend_cma::probe().unwrap();
    let p = Publisher::spawn();
    let rx = CmaTransport::new("gather-receiver", CmaOptions::default()).unwrap();
    rx.load_peer(OWNER, p.meta.clone().into()).await.unwrap();
    let reg = rx
        .register(Arc::new(HostBuffer::zeroed(4096)))
        .await
        .unwrap();
    // 4 rows of 10 every 400 bytes from 1000 bytes before the end: the last row ends 210
    // bytes past it.
    let from = REGION - 1000;
    let r = gather(&p, reg.id(), 0, from, 40, Some((10, 400)));
    let e = rx
        .prepare(ReadBatch { reads: vec![r] })
        .await
        .expect_err("a gather past the region's end");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(OWNER));
    assert_eq!(e.context().range, Some(from..REGION + 210), "{e}");
    // Its last row ending at the region's end is fine.
    let r = gather(&p, reg.id(), 0, REGION - 1210, 40, Some((10, 400)));
    rx.prepare(ReadBatch { reads: vec![r] }).await.unwrap();
}
