//! Collectives over two real Gloo ranks on loopback: the test re-runs its own binary as rank 0
//! and rank 1 (the way torchrun would start them) and checks what each rank ends with.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use rlhf_collective::{CollectiveError, InitOptions, Launch, ReduceOp, World};
use tch::{Kind, Tensor};

const CHILD: &str = "RLHF_COLLECTIVE_TEST_CHILD";

fn free_port() -> u16 {
    rlhf_collective::free_port().unwrap()
}

/// Runs test `name` of this binary as 2 ranks; returns each rank's (success, output).
fn two_ranks(name: &str) -> Vec<(bool, String)> {
    let port = free_port().to_string();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--exact", name, "--nocapture", "--test-threads", "1"])
                .env(CHILD, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("OMP_NUM_THREADS", "1")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            (out.status.success(), text)
        })
        .collect()
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

fn join(timeout: Duration) -> World {
    World::from_env(&InitOptions { timeout, threads: 1 }).expect("join")
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float)).unwrap()
}

#[test]
fn collectives_give_the_reduced_gathered_and_broadcast_values() {
    for (ok, out) in two_ranks("rank_collectives") {
        assert!(ok && out.contains("collectives ok"), "{out}");
    }
}

#[test]
fn rank_collectives() {
    if !is_child() {
        return;
    }
    let w = join(Duration::from_secs(60));
    let r = w.rank() as f32;
    assert_eq!(w.size(), 2);

    let t = Tensor::from_slice(&[r + 1.0, 10.0 * (r + 1.0)]);
    w.all_reduce(&t, ReduceOp::Sum).unwrap();
    assert_eq!(values(&t), [3.0, 30.0]);
    let t = Tensor::from_slice(&[r + 1.0, -r]);
    w.all_reduce(&t, ReduceOp::Mean).unwrap();
    assert_eq!(values(&t), [1.5, -0.5]);
    let t = Tensor::from_slice(&[r, -r]);
    w.all_reduce(&t, ReduceOp::Max).unwrap();
    assert_eq!(values(&t), [1.0, 0.0]);
    assert_eq!(w.all_reduce_f64(&[r as f64], ReduceOp::Min).unwrap(), [0.0]);

    let t = Tensor::from_slice(&[r * 7.0; 3]);
    w.broadcast(&t, 1).unwrap();
    assert_eq!(values(&t), [7.0; 3]);

    let parts = w.all_gather(&Tensor::from_slice(&[r, r + 0.5])).unwrap();
    assert_eq!(parts.iter().map(values).collect::<Vec<_>>(), [vec![0.0, 0.5], vec![1.0, 1.5]]);
    let bytes = w.all_gather_bytes(&vec![b'a' + w.rank() as u8; 3 + 2 * w.rank()]).unwrap();
    assert_eq!(bytes, [b"aaa".to_vec(), b"bbbbb".to_vec()]);

    // Gradients: summed in flat buckets (a small bucket size forces several), and a parameter
    // with no gradient on this rank gets a zero one.
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
    let b = Tensor::from_slice(&[1.0f32; 4]).view([2, 2]).set_requires_grad(true);
    let c = Tensor::from_slice(&[5.0f32]).set_requires_grad(true);
    let loss = a.sum(Kind::Float) * f64::from(r + 1.0) + b.sum(Kind::Float);
    loss.backward();
    if w.rank() == 1 {
        (c.sum(Kind::Float) * 2.0).backward();
    }
    w.all_reduce_grads(&[a.shallow_clone(), b.shallow_clone(), c.shallow_clone()], 16).unwrap();
    assert_eq!(values(&a.grad()), [3.0; 3]);
    assert_eq!(values(&b.grad().view([-1])), [2.0; 4]);
    assert_eq!(values(&c.grad()), [2.0]);

    // ZeRO's pair: rank r gets its half of the sum, then every rank the halves end to end, in
    // f32 and in bf16; a shard that does not fit the whole is a one-line error.
    for kind in [Kind::Float, Kind::BFloat16] {
        let input = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).f_mul_scalar(f64::from(r + 1.0)).unwrap();
        let input = input.to_kind(kind);
        let shard = Tensor::zeros([3], (kind, tch::Device::Cpu));
        w.reduce_scatter(&shard, &input).unwrap();
        let want = if w.rank() == 0 { [3.0, 6.0, 9.0] } else { [12.0, 15.0, 18.0] };
        assert_eq!(values(&shard), want);
        let whole = Tensor::zeros([6], (kind, tch::Device::Cpu));
        w.all_gather_into(&whole, &shard).unwrap();
        assert_eq!(values(&whole), [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]);
        // Started without waiting, a blocking collective run meanwhile, then waited for.
        let early = Tensor::zeros([6], (kind, tch::Device::Cpu));
        let pending = w.all_gather_into_async(&early, &shard).unwrap();
        let other = Tensor::from_slice(&[r + 1.0]).to_kind(kind);
        w.all_reduce(&other, ReduceOp::Sum).unwrap();
        pending.wait().unwrap();
        assert_eq!(values(&early), [3.0, 6.0, 9.0, 12.0, 15.0, 18.0]);
        assert_eq!(values(&other), [3.0]);
        let late = Tensor::zeros([3], (kind, tch::Device::Cpu));
        w.reduce_scatter_async(&late, &input).unwrap().wait().unwrap();
        assert_eq!(values(&late), want);
    }
    let err = w.reduce_scatter(
        &Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)),
        &Tensor::zeros([6], (Kind::Float, tch::Device::Cpu)),
    );
    let err = err.unwrap_err().to_string();
    assert!(err.contains("reduce_scatter") && err.contains("do not fit 2 ranks") && !err.contains('\n'), "{err}");

    // Parameters broadcast from rank 0.
    let p = Tensor::from_slice(&[r; 2]);
    w.broadcast_all(&[p.shallow_clone()], 0).unwrap();
    assert_eq!(values(&p), [0.0; 2]);

    w.check_same(42, "parameters").unwrap();
    let err = w.check_same(w.rank() as u64, "parameters").unwrap_err().to_string();
    assert!(err.contains("parameters differ between rank 0 and rank(s) 1"), "{err}");
    let s = w.stats();
    assert!(s.calls > 10 && s.bytes > 0 && s.seconds > 0.0, "{s:?}");
    w.barrier().unwrap();
    println!("collectives ok");
}

#[test]
fn a_stuck_peer_fails_the_collective_after_the_timeout() {
    let outs = two_ranks("rank_timeout");
    let (ok0, out0) = &outs[0];
    assert!(!ok0, "{out0}");
    assert!(out0.contains("rank 0: all_reduce failed") && out0.contains("timed out after"), "{out0}");
}

#[test]
fn rank_timeout() {
    if !is_child() {
        return;
    }
    let w = join(Duration::from_secs(2));
    w.barrier().unwrap();
    if w.rank() == 1 {
        std::thread::sleep(Duration::from_secs(8));
        return;
    }
    let t0 = Instant::now();
    let r = w.all_reduce(&Tensor::from_slice(&[1.0f32]), ReduceOp::Sum);
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(7), "{waited:?}");
    panic!("{} (timed out after {waited:?})", r.unwrap_err());
}

#[test]
fn bad_rendezvous_are_one_line_errors() {
    if is_child() {
        return;
    }
    let opts = InitOptions { timeout: Duration::from_secs(2), threads: 1 };
    // Nobody hosts the store: a client gives up after the timeout.
    let port = free_port();
    let l = Launch {
        rank: 1,
        world_size: 2,
        local_rank: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        agent_store: false,
    };
    let t0 = Instant::now();
    let e = World::join(&l, &opts).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert!(matches!(e, CollectiveError::Init { rank: 1, .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")) && !msg.contains('\n'), "{msg}");
    // The port is taken: rank 0 cannot host the store.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let l = Launch { rank: 0, master_port: port, local_rank: 0, ..l };
    let e = World::join(&l, &opts).unwrap_err().to_string();
    assert!(e.contains("rank 0: cannot join") && !e.contains('\n'), "{e}");
}
