//! Activations between ranks of a hierarchical group: in-process through the local group,
//! between processes through a sending thread per destination.

use burn::prelude::*;
use burn::tensor::{DType, FloatDType};
use kiln_models::Activation;
use mpi::traits::*;

use super::group::{Hier, Message};
use crate::error::{Error, Result};
use std::sync::mpsc::channel;

impl Hier {
    pub(super) fn send_to(&self, to: usize, value: Activation) -> Result<()> {
        if let Some(local) = self.local_index_of[to] {
            return self.local.send(local, value);
        }
        let comm = self
            .mpi
            .clone()
            .expect("a rank in another process means the group spans processes");
        let dims = value.dims();
        let (dtype, values): (i64, Vec<f32>) = match value {
            Activation::Rank2(t) => encode(t),
            Activation::Rank3(t) => encode(t),
            Activation::Rank4(t) => encode(t),
        };
        let mut header = vec![dims.len() as i64, dtype];
        header.extend(dims.iter().map(|d| *d as i64));
        let tag = self.tag(self.rank, to);
        let dest = self.proc_of[to] as i32;
        let mut senders = self.senders.lock().unwrap_or_else(|p| p.into_inner());
        let sender = senders.entry(to).or_insert_with(|| {
            let (tx, rx) = channel::<Message>();
            std::thread::Builder::new()
                .name(format!("kiln-send-{}-{to}", self.rank))
                .spawn(move || {
                    for m in rx {
                        let p = comm.0.process_at_rank(dest);
                        p.send_with_tag(&m.header[..], tag);
                        p.send_with_tag(&m.values[..], tag);
                    }
                })
                .expect("spawn a sending thread");
            tx
        });
        sender
            .send(Message { header, values })
            .map_err(|_| Error::Worker("the sending thread stopped".into()))
    }

    pub(super) fn recv_from(&self, from: usize) -> Result<Activation> {
        if let Some(local) = self.local_index_of[from] {
            return self.local.recv(local);
        }
        let comm = self
            .mpi
            .as_ref()
            .expect("a rank in another process means the group spans processes");
        let tag = self.tag(from, self.rank);
        let p = comm.0.process_at_rank(self.proc_of[from] as i32);
        let (header, _) = p.receive_vec_with_tag::<i64>(tag);
        let (values, _) = p.receive_vec_with_tag::<f32>(tag);
        let dims: Vec<usize> = header[2..].iter().map(|d| *d as usize).collect();
        let dtype = match header[1] {
            1 => FloatDType::BF16,
            2 => FloatDType::F16,
            _ => FloatDType::F32,
        };
        let device = Device::flex();
        let data = |d: Vec<usize>| TensorData::new(values, d);
        Ok(match header[0] {
            2 => Activation::Rank2(Tensor::<2>::from_data(data(dims), &device).cast(dtype)),
            3 => Activation::Rank3(Tensor::<3>::from_data(data(dims), &device).cast(dtype)),
            _ => Activation::Rank4(Tensor::<4>::from_data(data(dims), &device).cast(dtype)),
        })
    }
}

/// A tensor's dtype code and values as f32 (exact for bf16 and f16).
fn encode<const D: usize>(t: Tensor<D>) -> (i64, Vec<f32>) {
    let code = match t.dtype() {
        DType::BF16 => 1,
        DType::F16 => 2,
        _ => 0,
    };
    (code, t.into_data().convert::<f32>().iter::<f32>().collect())
}
