/**
 * Fencing tokens: a per-name, strictly increasing number handed out with every grant, so a
 * protected resource can reject writes from a holder that has since lost its lock.
 *
 * @since 0.1.0
 */
import * as Brand from "effect/Brand"
import * as Order_ from "effect/Order"
import * as Schema_ from "effect/Schema"

/**
 * A fencing token. Every grant of a lock name carries a larger token than every earlier grant of
 * that name, on every backend; compare tokens, never clocks.
 *
 * @since 0.1.0
 * @category models
 */
export type FencingToken = bigint & Brand.Brand<"effect-lock/FencingToken">

/**
 * Builds a token from a bigint (for tests and for reading tokens back from storage). Tokens are
 * non-negative; a negative value is a defect in the caller.
 *
 * @since 0.1.0
 * @category constructors
 */
export const make: Brand.Brand.Constructor<FencingToken> = Brand.refined<FencingToken>(
  (n) => n >= 0n,
  (n) => Brand.error(`a fencing token is never negative, got ${n}`)
)

/**
 * Orders tokens: a larger token is a later grant.
 *
 * @since 0.1.0
 * @category instances
 */
export const Order: Order_.Order<FencingToken> = Order_.bigint

/**
 * Schema for a token encoded as a decimal string (bigints are not JSON).
 *
 * @since 0.1.0
 * @category schemas
 */
export const FencingTokenSchema = Schema_.BigInt.pipe(
  Schema_.greaterThanOrEqualToBigInt(0n),
  Schema_.brand("effect-lock/FencingToken")
)

/**
 * Schema for a token held as a bigint in memory.
 *
 * @since 0.1.0
 * @category schemas
 */
export const FencingTokenFromSelf = Schema_.BigIntFromSelf.pipe(
  Schema_.greaterThanOrEqualToBigInt(0n),
  Schema_.brand("effect-lock/FencingToken")
)

/**
 * `FencingTokenSchema` under the conventional name.
 *
 * @since 0.1.0
 * @category schemas
 */
export const Schema = FencingTokenSchema
