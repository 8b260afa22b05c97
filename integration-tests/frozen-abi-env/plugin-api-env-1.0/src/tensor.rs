//! Tensors crossing the boundary as opaque handles to a libtorch `at::Tensor` (tch's `C_tensor`).
//! Host and plugins link the same tch and the same libtorch shared libraries, so a handle made on
//! one side is valid on the other.
//!
//! Ownership: a [`TensorRef`] is borrowed for the duration of a call — the receiver never frees it
//! and takes its own reference with [`TensorRef::to_tensor`]. A [`TensorBox`] transfers ownership;
//! dropping it frees the handle. Plugin code only sees `tch::Tensor`.

use std::ffi::c_void;
use std::marker::PhantomData;

use abi_stable::StableAbi;
use tch::Tensor;

/// A borrowed tensor handle, valid while `'a` lives.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy)]
pub struct TensorRef<'a> {
    ptr: *mut c_void,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> TensorRef<'a> {
    /// Borrows a tensor.
    pub fn new(t: &'a Tensor) -> Self {
        TensorRef { ptr: t.as_ptr() as *mut c_void, _borrow: PhantomData }
    }

    /// A new `tch::Tensor` sharing storage and autograd history with the borrowed one.
    pub fn to_tensor(&self) -> Tensor {
        // SAFETY: `ptr` came from a live `tch::Tensor` borrowed for 'a (see `new`); shallow_clone
        // only bumps libtorch's reference count and returns a fresh handle that we own.
        unsafe { Tensor::clone_from_ptr(self.ptr as *mut torch_sys::C_tensor) }
    }
}

impl std::fmt::Debug for TensorRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorRef({:?})", self.to_tensor().size())
    }
}

/// An owned tensor handle; ownership moves with the value.
#[repr(transparent)]
#[derive(StableAbi)]
pub struct TensorBox {
    ptr: *mut c_void,
}

// SAFETY: an at::Tensor handle may move between threads; libtorch reference counts are atomic.
unsafe impl Send for TensorBox {}

impl TensorBox {
    /// Takes ownership of a tensor.
    pub fn new(mut t: Tensor) -> Self {
        let ptr = t.as_mut_ptr() as *mut c_void;
        std::mem::forget(t);
        TensorBox { ptr }
    }

    /// Gives the tensor back.
    pub fn into_tensor(self) -> Tensor {
        let ptr = self.ptr;
        std::mem::forget(self);
        // SAFETY: `ptr` was produced by `new` from an owned tensor that was forgotten, so this is
        // the only owner.
        unsafe { Tensor::from_ptr(ptr as *mut torch_sys::C_tensor) }
    }
}

impl Drop for TensorBox {
    fn drop(&mut self) {
        // SAFETY: as in `into_tensor`; dropping the Tensor frees the handle exactly once.
        drop(unsafe { Tensor::from_ptr(self.ptr as *mut torch_sys::C_tensor) });
    }
}

impl std::fmt::Debug for TensorBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorBox")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_keep_autograd() {
        let x = Tensor::from_slice(&[1f32, 2., 3.]).set_requires_grad(true);
        let r = TensorRef::new(&x);
        let y = r.to_tensor();
        let b = TensorBox::new((&y * 2.0).sum(tch::Kind::Float));
        let loss = b.into_tensor();
        loss.backward();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![2., 2., 2.]);
        drop(TensorBox::new(Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu))));
    }
}
