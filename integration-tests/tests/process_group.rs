//! The process-group helper the opt-in vLLM tests start their server with: a server that starts
//! workers of its own (here a shell that starts two sleepers, one ignoring SIGTERM) is ended with
//! every process of its group, whether the test passes or panics.

use std::process::Command;
use std::time::Duration;

use rlhf_integration_tests::{group_members, ProcessGroup};

/// A shell with two sleepers; with `stubborn` one of them ignores SIGTERM (it takes SIGKILL).
fn server(stubborn: bool) -> ProcessGroup {
    let script = if stubborn { "sleep 300 & (trap '' TERM; sleep 300) & wait" } else { "sleep 300 & sleep 300 & wait" };
    let mut cmd = Command::new("sh");
    cmd.args(["-c", script]);
    let group = ProcessGroup::spawn(&mut cmd).unwrap();
    // The shell and its two children.
    let t0 = std::time::Instant::now();
    while group.members().len() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(10), "workers not started: {:?}", group.members());
        std::thread::sleep(Duration::from_millis(20));
    }
    group
}

#[test]
fn stopping_the_group_ends_every_worker() {
    let mut group = server(true);
    group.stop_within(Duration::from_secs(1));
    assert_eq!(group.members(), Vec::<u32>::new(), "processes of group {} left", group.id());
}

#[test]
fn a_panicking_test_still_ends_the_group() {
    let id = std::sync::Mutex::new(0u32);
    let result = std::panic::catch_unwind(|| {
        let group = server(false);
        *id.lock().unwrap() = group.id();
        panic!("the test failed");
    });
    assert!(result.is_err());
    let id = *id.lock().unwrap();
    assert!(id > 0);
    assert!(group_members(id).is_empty(), "processes {:?} of the panicked test's group are left", group_members(id));
}
