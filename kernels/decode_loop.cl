// The decode loop on the device: the token a decode step chose becomes the next step's input, so the host can
// enqueue step n + 1 before it reads step n's token.
//
// chosen (1 int32): the token the step chose (the argmax's output); step (2 int32): the token id and the
// position the next decode step reads (its gather and the kernels that read their position on the device);
// tokens (capacity int32): each chosen token at its position modulo capacity, read back by the host a step
// behind. One work-item: the step's last launch, a handful of integer moves.

__kernel __attribute__((reqd_work_group_size(1, 1, 1)))
void next_step(__global const int* restrict chosen, __global int* restrict step, __global int* restrict tokens,
               const int capacity)
{
    const int token = chosen[0];
    const int pos = step[1] + 1;
    step[0] = token;
    step[1] = pos;
    tokens[pos % capacity] = token;
}
